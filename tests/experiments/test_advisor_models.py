"""The advisor suite's models: published sizes at width 1.0 (GPT-2 small, ViT-B/16), checkpointable through
their blocks, trainable at toy scale with the batches and loss the suite gives them; figures marked toy scale."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from workbench.advisor.blocks import find_blocks  # noqa: E402
from workbench.advisor.configs import checkpoint_kind  # noqa: E402
from workbench.experiments.advisor import plots  # noqa: E402
from workbench.experiments.advisor.models import SUITE, lm_loss, reduced, suite_model  # noqa: E402


def test_width_one_is_the_published_size():
    assert suite_model("gpt2", width=1.0, image_size=224).parameters == 124_439_808  # GPT-2 small, tied head
    with torch.device("meta"):
        vit = suite_model("vit", width=1.0, image_size=224).build()
    assert vit.patches.kernel_size == (16, 16) and vit.pos.shape == (1, 197, 768)  # ViT-B/16: 14 x 14 patches
    assert sum(p.numel() for p in vit.parameters()) == 85_806_346  # ViT-B/16 with a 10-class head


@pytest.mark.parametrize("name", ["vit", "gpt2"])
def test_the_transformers_train_at_toy_scale_and_open_through_their_blocks(name):
    model = suite_model(name, width=0.125, image_size=16)
    assert checkpoint_kind(model.build) == "blocks"
    torch.manual_seed(0)
    net = model.build()
    assert len(find_blocks(net)) == 12
    x, y = model.batch(3)
    loss = (model.loss_fn or torch.nn.functional.cross_entropy)(net(x), y)
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in net.parameters())
    if name == "gpt2":  # token ids below the vocabulary, targets the next tokens
        assert x.dtype == torch.long and x.shape == (3, 8) and int(x.max()) < model.vocab
        assert net.lm_head.weight is net.tokens.weight


def test_lm_loss_is_cross_entropy_over_every_position_and_bad_names_are_refused():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    with pytest.raises(ValueError, match=r"model must be one of .*'gpt3'"):
        suite_model("gpt3", width=0.125, image_size=16)
    with pytest.raises(ValueError, match="image_size must be a whole number of pixels in 8..1024, got 4"):
        suite_model("vit", width=0.125, image_size=4)
    assert set(SUITE) >= {"resnet50", "densenet_bc_100", "vit", "gpt2"}


def test_figures_are_marked_toy_scale_with_verdicts_off_or_models_reduced():
    assert reduced(1.0, 224) == "" and reduced(0.125, 16) == "width x0.125, 16 px (sequences 8 tokens)"
    table = pd.DataFrame({"config": ["fp32", "bf16+0"], "predicted_peak_bytes": [2e6, 1e6],
                          "predicted_step_seconds": [0.01, 0.02], "fits": [False, True]})
    candidates = table.assign(model="vit", measured_peak_bytes=[2e6, 1e6], measured_step_seconds=[0.01, 0.02])

    def marks(fig):
        return [t.get_text() for t in fig.texts if "toy scale" in t.get_text()]

    try:
        for verdicts, scale, expected in ((False, "", [plots.TOY_SCALE]), (True, "", []),
                                          (True, "width x0.125", ["toy scale: width x0.125 (our targets are judged "
                                                                  "at it)"])):
            figs = [plots.plot_pareto(table, budget=1.5e6, choice="bf16+0", verdicts=verdicts, reduced=scale),
                    plots.plot_prediction(candidates, verdicts=verdicts, reduced=scale)]
            assert [marks(f) for f in figs] == [expected, expected]
        with pytest.raises(TypeError, match="verdicts must be a bool"):
            plots.plot_prediction(candidates, verdicts="no")
    finally:
        plt.close("all")

"""CalcGraph on models written as their users write them (issue 37): a checkpoint called inside forward,
`nn.MultiheadAttention` self-attention, a weight-tied causal decoder at batch 1 and a tagger that packs its
sequences. Each plan is judged against `AllocatorMeter` (the c10 allocator's events, no counting rule shared
with the plan) over the user's own loop: model and Adam built inside the meter, two steps, a fresh batch per
step as a loader hands it over; at batches calibration never ran (it runs 1, 2, 4, 8, 17, 32, 33, checks 16, 64
and 65).
Target: -2%..+5% of the allocator.

# NOTE: each plan calibrates by default (real steps at five batch sizes and two checks): the models are small
# so that the whole file stays within a few seconds per test on a quiet machine.
"""

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.checkpoint import checkpoint

from workbench.calcgraph import plan_training
from workbench.measure import AllocatorMeter

HELD_OUT = (3, 40)  # batches neither calibrated nor checked by the default calibration
LOW, HIGH = -0.02, 0.05


def user_loop_peak(build, batch, loss=F.cross_entropy, steps: int = 2) -> int:
    """Allocator peak of a user's training loop: build, Adam, `steps` steps on fresh batches from `batch()`."""
    gc.collect()  # garbage of an earlier test freed inside the meter would lower its count
    with AllocatorMeter("cpu") as meter:
        model = build().train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(steps):
            x, y = batch()
            loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return meter.peak_bytes


def error(graph, batch_size: int, real: int) -> float:
    return (graph.required_bytes(batch_size) - real) / real


def never_calibrated_at(graph, batch_size: int) -> bool:
    return graph.calibration is not None and batch_size not in graph.calibrated_batches


# the users' models ---------------------------------------------------------------------------------------
class CheckpointedCNN(nn.Module):
    """A convolutional block recomputed in backward (non-reentrant checkpoint, dropout inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.2),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h.mean((2, 3)))


class SelfAttention(nn.Module):
    """Project, attend to itself with nn.MultiheadAttention, residual, pool."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.proj(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(1))


VOCAB, CONTEXT, WIDTH = 512, 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TiedDecoder(nn.Module):
    """A causal decoder whose output projection is its token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln = nn.LayerNorm(WIDTH)
        self.register_buffer("mask", torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), 1))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask)
        return self.ln(x) @ self.tok.weight.t()


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.repeat_interleave(logits.shape[1]))


class Tagger(nn.Module):
    """A BiLSTM tagger over padded token ids (0 pads), packed to their lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens):
        lengths = (tokens != 0).sum(1).cpu()
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.head(out).mean(1)


def images(b):
    return lambda: (torch.randn(b, 3, 16, 16), torch.zeros(b, dtype=torch.long))


def sequences(b):
    return lambda: (torch.randn(b, 12, 16), torch.zeros(b, dtype=torch.long))


def tokens(b):
    return lambda: (torch.randint(0, VOCAB, (b, CONTEXT)), torch.zeros(b, dtype=torch.long))


# checkpoint inside forward -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpointed():
    return plan_training(CheckpointedCNN, (3, 16, 16))


@pytest.mark.parametrize("batch_size", HELD_OUT)
def test_a_checkpoint_inside_forward_is_planned_as_torch_recomputes_it(checkpointed, batch_size):
    assert never_calibrated_at(checkpointed, batch_size)
    real = user_loop_peak(CheckpointedCNN, images(batch_size))
    assert LOW <= error(checkpointed, batch_size, real) <= HIGH, error(checkpointed, batch_size, real)


def test_refined_calibration_is_one_fit_of_the_plan_not_a_correction_of_a_correction(checkpointed):
    refined = plan_training(CheckpointedCNN, (3, 16, 16), calibrate=False).calibrate(
        sizes=(1, 2, 4), check=(8,), tolerance=(0.0, 0.0), refine=2)  # every check that is not exact misses
    sizes = tuple(int(s) for s in refined.calibration.sizes)
    checked = tuple(int(b) for b in refined.calibration_error["batch_size"])
    # NOTE: since MemoryMeter counts torch.tensor's storages (lift_fresh) the plan is exact at 16 once 8 joined
    # the fit (one thread), so the rounds stop there: each round's check doubles the last one's batch
    assert checked == tuple(8 * 2**r for r in range(len(checked))) and sizes == (1, 2, 4, *checked)
    assert refined.calibration_error["refined"].max() == len(checked) - 1
    once = plan_training(CheckpointedCNN, (3, 16, 16), calibrate=False).calibrate(sizes=sizes, check=())
    for b in (*HELD_OUT, 48):
        assert refined.required_bytes(b) == pytest.approx(once.required_bytes(b), rel=0.005)
    assert refined.calibration_error["error"].abs().max() < 0.02  # no round flips the sign by ~19%


# nn.MultiheadAttention self-attention --------------------------------------------------------------------
@pytest.fixture(scope="module")
def attention():
    return plan_training(SelfAttention, (12, 16))


@pytest.mark.parametrize("batch_size", HELD_OUT)
def test_self_attention_is_planned_within_the_target(attention, batch_size):
    assert never_calibrated_at(attention, batch_size)
    real = user_loop_peak(SelfAttention, sequences(batch_size))
    assert LOW <= error(attention, batch_size, real) <= HIGH, error(attention, batch_size, real)


def test_the_plan_sums_gradients_in_place_where_the_users_program_does(attention):
    """Autograd adds the gradients of `h` (used by q, k, v and the residual) in place when no dispatch mode
    runs: the plan allocates exactly the out-of-place adds a profiled real step runs."""
    model = SelfAttention()
    with torch.profiler.profile() as prof:
        x = torch.randn(4, 12, 16)
        F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    real_adds = sum(e.name == "aten::add" for e in prof.events())
    plain = plan_training(SelfAttention, (12, 16), calibrate=False)
    frame = plain.variables(4)
    planned_adds = int(((frame["op"] == "add.Tensor") & (frame["phase"] == "step2")).sum())
    assert planned_adds == real_adds


# a tied causal decoder at batch 1 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder():
    return plan_training(TiedDecoder, torch.zeros(4, CONTEXT, dtype=torch.long), loss=next_token_loss)


@pytest.mark.parametrize("batch_size", (1, *HELD_OUT))
def test_a_tied_decoder_is_planned_at_batch_one_and_beyond(decoder, batch_size):
    """Batch 1 runs other kernels (a contiguous batch of one: one addmm where larger batches clone, mm and
    add), so it is traced on its own; calibration runs there too (its fit is checked at 1 as well)."""
    if batch_size != 1:
        assert never_calibrated_at(decoder, batch_size)
    real = user_loop_peak(TiedDecoder, tokens(batch_size), loss=next_token_loss)
    assert LOW <= error(decoder, batch_size, real) <= HIGH, error(decoder, batch_size, real)


def test_max_batch_refuses_a_budget_that_batch_one_overflows(decoder):
    real = user_loop_peak(TiedDecoder, tokens(1), loss=next_token_loss)
    with pytest.raises(ValueError, match="batch size 1 needs"):
        decoder.max_batch_size(0.99 * real)


# packed sequences ----------------------------------------------------------------------------------------
def user_batch(rows: int = 8, length: int = 20) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    lengths[0] = length
    ids = torch.randint(1, 100, (rows, length), generator=generator)
    return ids * (torch.arange(length) < lengths[:, None])


def test_packed_sequences_are_planned_at_the_users_lengths():
    sample = user_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = plan_training(Tagger, sample)
    assert not graph.affine and graph.calibration is None  # lengths come from the batch: traced per size
    assert any("not affine" in str(w.message) for w in caught)
    assert graph.calibrated_batches == [1]  # batch 1 alone, by one real step (issue 47)
    for b in (1, len(sample), *HELD_OUT):
        rows = torch.cat([sample] * (b // len(sample)) + [sample[: b % len(sample)]])
        real = user_loop_peak(Tagger, lambda rows=rows: (rows.clone(), torch.zeros(len(rows), dtype=torch.long)))
        assert LOW <= error(graph, b, real) <= HIGH, (b, error(graph, b, real))


class ConvTagger(nn.Module):
    """Issue 47's tagger: Conv1d features over embedded tokens, then a BiLSTM over the sequences packed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 12, padding_idx=0)
        self.conv = nn.Conv1d(12, 16, 3, padding=1)
        self.lstm = nn.LSTM(16, 20, batch_first=True, bidirectional=True)
        self.head = nn.Linear(40, 4)

    def forward(self, tokens):
        lengths = (tokens != 0).sum(1).cpu()
        features = self.conv(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        out, _ = self.lstm(pack_padded_sequence(features, lengths, batch_first=True, enforce_sorted=False))
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.head(out).mean(1)


def test_a_packed_bilstm_at_batch_one_counts_the_kernels_a_batch_of_one_runs():
    """One packed sequence ran oneDNN's LSTM, whose workspace the meta kernel reports as 0 bytes: the plan was
    -33% at batch 1 and exact at 2, 3 and 24 (issue 47). Batch 1 is calibrated on its own by one real step."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 16, (6,), generator=generator)
    sample = torch.randint(1, 50, (6, 16), generator=generator) * (torch.arange(16) < lengths[:, None])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not affine: said by the test above
        graph = plan_training(ConvTagger, sample)
        plain = plan_training(ConvTagger, sample, calibrate=False)
    for b in (1, 2, 3, 24):
        rows = torch.cat([sample] * (b // len(sample)) + [sample[: b % len(sample)]])
        real = user_loop_peak(ConvTagger, lambda rows=rows: (rows.clone(), torch.zeros(len(rows), dtype=torch.long)))
        assert LOW <= error(graph, b, real) <= HIGH, (b, error(graph, b, real))
        if b == 1:
            assert error(plain, b, real) < LOW  # the defect: fake tensors alone miss the workspace

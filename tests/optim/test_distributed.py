"""Packed optimizers under FSDP2 and DDP on 2 CPU ranks (gloo), against one process
(Lewandowski & Kosson 3.1-3.2; ``workbench.optim.distributed``).

One run of 2 ranks (``run_on_ranks``: spawned, joined, bounded in time) does every multi-process check
and returns what the tests compare; the one-process references and the load on 1 rank run here.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from workbench.calcgraph.sharded import run_on_ranks
from workbench.optim import PackedAdamW, PackedSGD, step_in_backward

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or "spawn" not in mp.get_all_start_methods(),
    reason="needs torch.distributed with gloo and the spawn start method")

STEPS, LR, WORLD = 4, 1e-2, 2


def _model():
    torch.manual_seed(0)  # 15 and 3 rows: uneven shards (8 + 7, 2 + 1) on 2 ranks
    return nn.Sequential(nn.Linear(12, 15), nn.ReLU(), nn.Linear(15, 3)).to(torch.bfloat16)


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g).bfloat16(), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _train(model, opt, batches, rank=0, world=1, *, in_backward=False):
    """The same global batch on every world size: each rank takes its 1/world of it."""
    for x, y in batches:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        nn.functional.cross_entropy(model(x).float(), y).backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()


def _packed(model, *, sr=False, seed=3):
    # bf16 + 16 bits is an exact fp32 master; with stochastic rounding, 7 bits + the flag (one byte plane)
    return PackedAdamW(model.parameters(), lr=LR, extra_bits=7 if sr else 16, stochastic_rounding=sr, seed=seed)


def _packed_sgd(model):
    return PackedSGD(model.parameters(), lr=LR, momentum=0.9, extra_bits=16)


def _error(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ddp_checks(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = _packed(model)
    out = {"wrapped": _error(lambda: step_in_backward(model, opt))}
    inner = _model()
    opt = _packed(inner)
    step_in_backward(inner, opt)  # registered first, wrapped afterwards: caught at the first forward
    wrapped, x = DDP(inner), _batches(1)[0][0]
    out["wrapped_later"] = _error(lambda: wrapped(x))
    model = DDP(_model())
    opt = _packed(model)
    _train(model, opt, _batches(2), rank, WORLD)  # DDP + an ordinary step: the replicas stay equal
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    return out


def _on_rank(rank, world, ckpt):
    out = {}
    model = _shard(_model())
    opt = _packed(model)
    _train(model, opt, _batches(), rank, world)
    out["params"] = [p.full_tensor() for p in model.parameters()]
    out["masters"] = [opt.master_weight(p).full_tensor() for p in model.parameters()]
    out["state_bytes"] = sum(v.to_local().nbytes for st in opt.state.values() for v in st.values()
                             if torch.is_tensor(v))
    out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["layouts"] = [(type(v).__name__, v.device_mesh == p.device_mesh, tuple(p.placements), tuple(v.placements),
                       tuple(v.shape), tuple(v.to_local().shape), tuple(p.to_local().shape))
                      for p in model.parameters() for k, v in opt.state[p].items() if k != "step"]
    # a one-process state dict loaded into the sharded optimizer: each rank cuts its shard of every state
    single = _model()
    single_opt = _packed(single)
    _train(single, single_opt, _batches(1))
    sharded_opt = _packed(model)
    sharded_opt.load_state_dict(single_opt.state_dict())
    out["cut_equal"] = all(
        torch.equal(sharded_opt.state[p][k].full_tensor(), v.view(-1, *q.shape) if k == "extra" else v)
        for p, q in zip(model.parameters(), single.parameters(), strict=True)
        for k, v in single_opt.state[q].items() if k != "step")
    sgd_model = _shard(_model())
    sgd = _packed_sgd(sgd_model)
    _train(sgd_model, sgd, _batches(), rank, world)
    out["sgd_masters"] = [sgd.master_weight(p).full_tensor() for p in sgd_model.parameters()]
    # step_in_backward: the hooks run after the reduce-scatter, so each rank steps with the summed gradient
    twin = _shard(_model())
    twin_opt = _packed(twin)
    step_in_backward(twin, twin_opt)
    _train(twin, twin_opt, _batches(), rank, world, in_backward=True)
    out["in_backward_equal"] = all(torch.equal(p.to_local(), q.to_local())
                                   for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    third = _shard(_model())
    out["scaler_refused"] = _error(lambda: step_in_backward(third, _packed(third),
                                                            grad_scale=torch.amp.GradScaler("cpu")))
    out["words_refused"] = _error(lambda: PackedAdamW(twin.parameters(), extra_bits=5))
    # torch.distributed.checkpoint: save on 2 ranks (stochastic rounding: a byte plane with the flag bit), the
    # rounding seed drawn from torch's generator (seed=None, the default), as a user's run has it
    model = _shard(_model())
    opt = _packed(model, sr=True, seed=None)
    _train(model, opt, _batches(), rank, world)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)
    out["saved"] = [{k: v.full_tensor() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                    for p in model.parameters()]
    out["saved_params"] = [p.full_tensor() for p in model.parameters()]
    fresh = _shard(nn.Sequential(nn.Linear(12, 15), nn.ReLU(), nn.Linear(15, 3)).to(torch.bfloat16))
    fresh_opt = _packed(fresh, sr=True, seed=None)
    out["seed_drawn_apart"] = fresh_opt.seed != opt.seed
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    out["seed_restored"] = fresh_opt.seed == opt.seed
    _train(model, opt, _batches(2), rank, world)  # and both continue alike (same seed: same rounding bits)
    _train(fresh, fresh_opt, _batches(2), rank, world)
    out["reload_equal"] = all(torch.equal(p.to_local(), q.to_local())
                              for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    out["ddp"] = _ddp_checks(rank)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dcp")
    return run_on_ranks(_on_rank, WORLD, str(ckpt), timeout=240), ckpt


def test_fsdp2_matches_one_process_within_bf16_rounding(ranks):
    results, _ = ranks
    model = _model()
    opt = _packed(model)
    _train(model, opt, _batches())
    for r in results:
        for got, want, master, ref in zip(r["params"], model.parameters(), r["masters"],
                                          [opt.master_weight(p) for p in model.parameters()], strict=True):
            want = want.detach()
            # The only difference is the gradient: each rank rounds its half-batch gradient to bf16 before
            # the reduce-scatter adds them (one process rounds the whole batch's once), a relative 2**-8 per
            # rounding. Adam's normalised update moves by about that fraction of lr per step: measured
            # 2**-8.7 * STEPS * LR on the fp32 masters; the bound allows 8 times that.
            torch.testing.assert_close(master, ref, rtol=0, atol=STEPS * LR * 2**-5)
            # The bf16 parameters are the masters rounded toward zero: they differ by at most the masters'
            # difference plus one bf16 step (2**-7 relative) where a rounding boundary lies between them.
            big = torch.maximum(got.float().abs(), want.float().abs())
            ulp = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 8)
            assert ((got.float() - want.float()).abs() <= (master - ref).abs() + ulp).all()


def test_packed_sgd_under_fsdp2_matches_one_process(ranks):
    model = _model()
    start = [p.detach().float() for p in model.parameters()]
    opt = _packed_sgd(model)
    _train(model, opt, _batches())
    for r in ranks[0]:
        for got, p, p0 in zip(r["sgd_masters"], model.parameters(), start, strict=True):
            want = opt.master_weight(p)
            # SGD moves by lr times the gradient, whose two half-batch halves each rank rounds to bf16 (2**-8
            # relative) before they are summed: the fp32 masters differ by a small fraction of the movement
            # (measured under 2**-7.5 of the largest movement; the bound allows 2**-5)
            moved = (want - p0).abs().max()
            torch.testing.assert_close(got, want, rtol=0, atol=float(moved) * 2**-5)


def test_each_rank_holds_its_shard_of_the_state(ranks):
    results, _ = ranks
    total = sum(p.numel() for p in _model().parameters())
    assert sum(r["local_numel"] for r in results) == total
    for r in results:  # fp32 exp_avg and exp_avg_sq (8 bytes) + two extra-bit byte planes, for its shard only
        assert r["state_bytes"] == 10 * r["local_numel"] < 10 * total


def test_states_are_dtensors_laid_out_like_their_parameter(ranks):
    from torch.distributed.tensor import Shard

    for r in ranks[0]:
        assert len(r["layouts"]) == 3 * 4  # 4 parameters: exp_avg, exp_avg_sq, extra each
        for kind, same_mesh, param_pl, state_pl, shape, local_shape, param_local in r["layouts"]:
            assert kind == "DTensor" and same_mesh and param_pl == (Shard(0),)
            lead = len(shape) - len(param_local)  # the byte planes' leading dimension (extra bits)
            assert state_pl == (Shard(lead),) and local_shape[lead:] == param_local


def test_a_one_process_state_dict_loads_into_the_sharded_optimizer(ranks):
    assert all(r["cut_equal"] for r in ranks[0])


def test_step_in_backward_under_fsdp2_is_an_ordinary_step(ranks):
    results, _ = ranks
    assert all(r["in_backward_equal"] for r in results)
    assert "GradScaler" in results[0]["scaler_refused"] and "ranks could disagree" in results[0]["scaler_refused"]


def test_dense_words_are_refused_for_dtensor_parameters(ranks):
    assert "cannot be sharded with the parameter" in ranks[0][0]["words_refused"]


def test_checkpoint_reloads_exactly_on_two_ranks_and_continues_alike(ranks):
    # without seed=: the resumed optimizer drew another rounding seed, and the checkpoint gives it the saved one
    assert all(r["seed_drawn_apart"] and r["seed_restored"] and r["reload_equal"] for r in ranks[0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_reloads_exactly_on_one_rank_after_resharding(ranks):
    results, ckpt = ranks
    model = _model()
    opt = _packed(model, sr=True)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    saved = results[0]["saved"]
    for p, want, st in zip(model.parameters(), results[0]["saved_params"], saved, strict=True):
        assert torch.equal(p.detach(), want)
        assert opt.state[p]["step"] == st["step"] == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], st[key])
        assert torch.equal(opt.state[p]["extra"].view(st["extra"].shape), st["extra"])  # (planes, *shape)
        assert st["extra"].shape == (1, *p.shape) and math.prod(st["extra"].shape) == p.numel()


def test_step_in_backward_is_refused_under_ddp_saying_why(ranks):
    ddp = ranks[0][0]["ddp"]
    for message in (ddp["wrapped"], ddp["wrapped_later"]):
        assert message.startswith("RuntimeError: step_in_backward on a") and "unsynchronised gradient" in message
    assert "wrapped after step_in_backward" in ddp["wrapped_later"]
    assert all(r["ddp"]["replicas_equal"] for r in ranks[0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_integer_keyed_state_dict_through_dcp_is_refused(tmp_path):
    model = _model()
    opt = _packed(model)
    _train(model, opt, _batches(1))
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp_path)
    other_model = _model()
    other = _packed(other_model)
    _train(other_model, other, _batches(1))
    sd = {"optim": other.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path)  # the steps come back under string keys: '0', '1', ...
    with pytest.raises(ValueError, match=r"belong to no parameter.*get_optimizer_state_dict"):
        other.load_state_dict(sd["optim"])


def test_state_dicts_shape_byte_planes_like_the_parameter_and_load_the_old_layout():
    model = _model()
    opt = _packed(model, sr=True)
    _train(model, opt, _batches(1))
    sd = opt.state_dict()
    p = next(model.parameters())
    assert sd["state"][0]["extra"].shape == (1, *p.shape) and opt.state[p]["extra"].shape == (1, p.numel())
    old = {**sd, "state": {i: {**st, "extra": st["extra"].reshape(1, -1)} for i, st in sd["state"].items()}}
    for saved in (sd, old):
        twin_model = _model()
        twin = _packed(twin_model, sr=True)
        twin.load_state_dict(saved)
        q = next(twin_model.parameters())
        assert torch.equal(twin.state[q]["extra"], opt.state[p]["extra"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("path", ["state_dict", "dcp"])
def test_the_rounding_seed_survives_every_checkpoint_path_without_an_explicit_seed(tmp_path, path):
    # issue 37: get_optimizer_state_dict kept "state" and "param_groups" only, so the seed of seed=None was lost
    # and a resumed run rounded with another one
    model = _model()
    opt = _packed(model, sr=True, seed=None)
    _train(model, opt, _batches(2))
    torch.manual_seed(123)  # the resumed process draws another seed
    resumed_model = _model()
    resumed = _packed(resumed_model, sr=True, seed=None)
    torch.manual_seed(456)
    resumed.seed = int(torch.randint(0, 2**31 - 1, ()))
    assert resumed.seed != opt.seed
    if path == "state_dict":
        resumed_model.load_state_dict(model.state_dict())
        resumed.load_state_dict(opt.state_dict())
    else:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=tmp_path)
        sd = {"model": get_model_state_dict(resumed_model), "optim": get_optimizer_state_dict(resumed_model, resumed)}
        dcp.load(sd, checkpoint_id=tmp_path)
        set_model_state_dict(resumed_model, sd["model"])
        set_optimizer_state_dict(resumed_model, resumed, sd["optim"])
    assert resumed.seed == opt.seed and "sr_seed" not in resumed.param_groups[0]
    _train(model, opt, _batches(3)[2:])
    _train(resumed_model, resumed, _batches(3)[2:])
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)

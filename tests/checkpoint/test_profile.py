"""Checkpoint units (residual blocks opened) and the per-unit profile plans are made from (OpTorch,
Sec. II-B-2). Tests ``workbench.checkpoint.profile``."""

from __future__ import annotations

import torch
from torch import nn

from workbench.checkpoint import profile_layers, units_of


def test_profile_sizes() -> None:
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    prof = profile_layers(net, torch.randn(3, 5))
    assert prof.out_bytes == [3 * 7 * 4, 3 * 7 * 4, 3 * 2 * 4]
    # Linear 1 saves its input (the sample, never counted), ReLU its output, Linear 2 its input
    assert [prof.saved_bytes(i) for i in range(3)] == [0, 84, 84]
    assert list(prof.to_frame().columns) == ["unit", "name", "time_s", "out_bytes", "saved_bytes",
                                             "forward_bytes", "backward_bytes", "grad_bytes"]
    # Linear 2's backward makes grad_input (3x7 floats) and its weight/bias grads (2x7 + 2)
    assert prof.backward_bytes[2] >= 3 * 7 * 4
    assert prof.grad_bytes == [84, 84, 24] and prof.forward_bytes[0] >= 84
    assert prof.loss_bytes >= 24  # the output gradient the loss's backward makes
    assert all(p.grad is None for p in net.parameters())  # profiling leaves no gradients


def test_units_open_residual_blocks(tiny_resnet) -> None:
    net = tiny_resnet()
    assert len(units_of(net, split_blocks=False)) == len(net)
    units = units_of(net)
    # each BasicBlock becomes fork + 5 body layers + merge
    assert len(units) == len(net) + 8 * 6
    x = torch.randn(2, 3, 8, 8)
    net.eval()
    state = x
    for u in units:
        state = u(state)
    torch.testing.assert_close(state, net(x), rtol=0, atol=0)

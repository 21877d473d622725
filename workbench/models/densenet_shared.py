"""The shared-storage form of DenseNet's concat-BN-ReLU-conv segment (one autograd Function).

Paper: Pleiss, Chen, Huang, Li, van der Maaten, Weinberger, "Memory-Efficient Implementation of
DenseNets" (2017), Section 4 ("Memory-Efficient Implementation": Shared Memory Storage 1 for the
concatenation and 2 for the batch-normalization output, Fig 3 right; the backward pass first
re-computes concatenation and batch normalization to re-populate the storages).

:class:`SharedStorage` is the pair of storages, one object per forward pass, reused by every dense
layer; :class:`SharedConcatBNReLUConv` computes ``conv(relu(bn(cat(features))))`` writing the
concatenation and the BN + ReLU output into it, saves only the layer's inputs (kept anyway) and
re-populates the storages in backward before computing gradients. Gradient storage is not shared by
hand: as the paper notes, PyTorch frees (and its allocator reuses) gradient buffers on its own.
Under ``create_graph=True`` the backward falls back to recomputing the segment with ordinary
autograd ops, so double backward works. :func:`bn_momentum` advances BatchNorm's counter and gives the
running-statistics factor, as ``nn.BatchNorm2d``'s forward does. The model using them is ``workbench.models.densenet``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SharedConcatBNReLUConv", "SharedStorage", "bn_momentum"]


def bn_momentum(bn: nn.BatchNorm2d) -> float:
    """Advance ``num_batches_tracked`` and return the running-stat factor, as BatchNorm2d does."""
    if not (bn.training and bn.track_running_stats):
        return 0.0
    bn.num_batches_tracked.add_(1)
    return 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum


class SharedStorage:
    """Shared Memory Storage 1 (concatenation) and 2 (BN + ReLU output) of Section 4.

    NOTE: one object per forward pass (not per model): it is freed with the autograd graph that
    references it, is counted by memory meters like any activation, and two graphs in flight
    never share a buffer. Backward re-populates it anyway, so sharing would also be correct.
    With ``per_block`` each dense block sizes it exactly for its widest layer on entry, so after
    the forward pass it holds the last block's size (the first block's maps are 4-16x larger);
    backward grows it again block by block. Otherwise (the paper's design) the model reserves
    the largest size once before the first block and it is never resized.
    """

    def __init__(self, *, per_block: bool = True) -> None:
        self.per_block = per_block
        self.concat: Tensor | None = None
        self.normed: Tensor | None = None

    def reserve(self, numel: int, like: Tensor, *, exact: bool = False) -> None:
        """Make room for `numel` elements; `exact` also shrinks (used once per dense block)."""
        c = self.concat
        if (c is None or c.numel() < numel or (exact and c.numel() != numel)
                or c.dtype != like.dtype or c.device != like.device):
            self.concat = self.normed = None  # release the old pair before allocating
            self.concat = like.new_empty(numel)
            self.normed = like.new_empty(numel)

    def views(self, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        n = math.prod(shape)
        assert self.concat is not None and self.normed is not None and self.concat.numel() >= n
        return self.concat[:n].view(shape), self.normed[:n].view(shape)


class SharedConcatBNReLUConv(torch.autograd.Function):
    """conv(relu(bn(cat(features)))) writing the concat and BN output into shared storage."""

    @staticmethod
    def forward(ctx, storage, bn_weight, bn_bias, running_mean, running_var, conv_weight,
                training, momentum, eps, padding, *features):
        # NOTE: the segment runs in the parameters' dtype with autocast off: under autocast the
        # features arrive in half precision and are cast while copied into the storage; the
        # hand-written backward then never mixes dtypes (autograd casts the feature gradients
        # back). So under autocast conv1 is computed in full precision, unlike the naive form.
        with torch.autocast(features[0].device.type, enabled=False):
            return SharedConcatBNReLUConv._forward(
                ctx, storage, bn_weight, bn_bias, running_mean, running_var, conv_weight,
                training, momentum, eps, padding, *features)

    @staticmethod
    def _forward(ctx, storage, bn_weight, bn_bias, running_mean, running_var, conv_weight,
                 training, momentum, eps, padding, *features):
        n, _, h, w = features[0].shape
        sizes = [f.shape[1] for f in features]
        shape = (n, sum(sizes), h, w)
        storage.reserve(math.prod(shape), bn_weight)
        concat, normed = storage.views(shape)
        torch.cat(features, dim=1, out=concat)
        if training:
            mean, invstd = concat.new_empty(shape[1]), concat.new_empty(shape[1])
            torch.ops.aten.native_batch_norm.out(
                concat, bn_weight, bn_bias, running_mean, running_var, True, momentum, eps,
                out=normed, save_mean=mean, save_invstd=invstd)
            stat_a, stat_b = mean, invstd
        else:
            # NOTE: copies (per-channel, tiny) so a later train step cannot change what
            # this graph's backward uses.
            stat_a, stat_b = running_mean.clone(), running_var.clone()
            torch.ops.aten.native_batch_norm.out(
                concat, bn_weight, bn_bias, stat_a, stat_b, False, 0.0, eps,
                out=normed, save_mean=concat.new_empty(0), save_invstd=concat.new_empty(0))
        normed.relu_()
        out = F.conv2d(normed, conv_weight, padding=padding)
        ctx.storage, ctx.training, ctx.eps, ctx.padding = storage, training, eps, padding
        ctx.sizes, ctx.shape = sizes, shape
        ctx.save_for_backward(bn_weight, bn_bias, conv_weight, stat_a, stat_b, *features)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        bn_weight, bn_bias, conv_weight, stat_a, stat_b, *features = ctx.saved_tensors
        if torch.is_grad_enabled():  # backward(create_graph=True): a double backward will follow
            return SharedConcatBNReLUConv._recompute_backward(
                ctx, grad_out, bn_weight, bn_bias, conv_weight, stat_a, stat_b, features)
        needs = ctx.needs_input_grad
        need_features = any(needs[10:])
        storage = ctx.storage
        storage.reserve(math.prod(ctx.shape), bn_weight)
        concat, normed = storage.views(ctx.shape)
        # Re-populate Shared Storage 1 and 2 (Section 4, "The backward pass requires one
        # additional step"), using the statistics of the forward pass.
        torch.cat(features, dim=1, out=concat)
        invstd = stat_b if ctx.training else torch.rsqrt(stat_b + ctx.eps)
        scale = bn_weight * invstd
        shift = bn_bias - stat_a * scale
        torch.addcmul(shift.view(1, -1, 1, 1), concat, scale.view(1, -1, 1, 1), out=normed)
        normed.relu_()
        need_bn = need_features or needs[1] or needs[2]
        grad_normed, grad_conv, _ = torch.ops.aten.convolution_backward(
            grad_out, normed, conv_weight, None, [1, 1], [ctx.padding] * 2, [1, 1], False,
            [0, 0], 1, [need_bn, needs[5], False])
        grads_bn: tuple = (None, None, None)
        if need_bn:
            # ReLU backward, written over the fresh gradient (masked_fill_ is ~10x slower on CPU)
            torch.ops.aten.threshold_backward.grad_input(grad_normed, normed, 0,
                                                         grad_input=grad_normed)
            if ctx.training:
                stats = (None, None, stat_a, stat_b)
            else:
                stats = (stat_a, stat_b, None, None)
            grads_bn = torch.ops.aten.native_batch_norm_backward(
                grad_normed, concat, bn_weight, *stats, ctx.training, ctx.eps,
                [need_features, needs[1], needs[2]])
        grad_concat, grad_bn_w, grad_bn_b = grads_bn
        grad_features = ((None,) * len(features) if grad_concat is None
                         else grad_concat.split(ctx.sizes, dim=1))
        return (None, grad_bn_w, grad_bn_b, None, None, grad_conv,
                None, None, None, None, *grad_features)

    @staticmethod
    def _recompute_backward(ctx, grad_out, bn_weight, bn_bias, conv_weight, stat_a, stat_b,
                            features):
        """The checkpoint form's backward: recompute the segment with autograd ops and
        differentiate it with ``create_graph=True``, so higher-order gradients exist.

        NOTE: the hand-written backward above is not itself differentiable (it writes into the
        shared storages in place). Under ``create_graph`` this path replaces it: same values
        (the forward's batch statistics are recomputed from the same inputs; eval mode uses the
        saved running statistics), and the recomputed intermediates are held by the
        higher-order graph, as they would be by the checkpoint form.
        """
        needs = ctx.needs_input_grad
        # NOTE: differentiate with respect to fresh aliases (views) of the inputs, not the inputs
        # themselves: an earlier feature is also an ancestor of a later one, and autograd.grad
        # would add that path (a total derivative). The aliases' only use is this segment, so the
        # result is the partial derivative, and it stays differentiable back to the inputs.
        inputs = [bn_weight, bn_bias, conv_weight, *features]
        index = [1, 2, 5, *range(10, 10 + len(features))]
        alias = [t.view_as(t) if needs[i] else t for i, t in zip(index, inputs, strict=True)]
        bn_weight, bn_bias, conv_weight, *features = alias
        wanted = [(i, t) for i, t in zip(index, alias, strict=True) if needs[i]]
        result: list[Tensor | None] = [None] * (10 + len(features))
        if not wanted:
            return tuple(result)
        with torch.autocast(grad_out.device.type, enabled=False):
            concat = torch.cat([f.to(bn_weight.dtype) for f in features], dim=1)
            if ctx.training:
                normed = F.batch_norm(concat, None, None, bn_weight, bn_bias, True, 0.0, ctx.eps)
            else:
                normed = F.batch_norm(concat, stat_a, stat_b, bn_weight, bn_bias, False, 0.0,
                                      ctx.eps)
            out = F.conv2d(F.relu(normed), conv_weight, padding=ctx.padding)
            grads = torch.autograd.grad(out, [t for _, t in wanted], grad_out, create_graph=True,
                                        allow_unused=True)
        for (i, _), g in zip(wanted, grads, strict=True):
            result[i] = g
        return tuple(result)

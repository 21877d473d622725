"""DenseNet-BC in four memory forms: two naive baselines, checkpointed and shared-storage.

Paper: Pleiss, Chen, Huang, Li, van der Maaten, Weinberger, "Memory-Efficient Implementation of
DenseNets" (2017).

- Section 2: a dense layer is H_l([x_1, ..., x_{l-1}]) = Conv(ReLU(BN(concat))), pre-activation;
  DenseNet-BC (Huang et al.) adds a 1x1 bottleneck to `bn_size * k` channels and halves the
  channels in each transition (compression 0.5).
- Section 3, ``memory="naive"``: every layer allocates its own concatenation and its own BN output;
  autograd keeps both for backward, so feature-map memory grows quadratically with depth. This is
  PyTorch's naive form: autograd frees each intermediate gradient once used, which is the paper's
  "shared gradient" implementation (Section 5: "PyTorch automatically performs this optimization").
- Sections 3 and 5, ``memory="luatorch"``: the paper's own naive baseline, modelled on the original
  LuaTorch code, where every module owns its output and gradient buffers for the whole step. Each
  layer's concatenation and BN output are held until the step's graph is freed, and so are their
  gradients (the concatenated-feature gradient and the BN-output gradient): the "four operations
  with quadratic memory growth". Only these quadratic buffers are held; LuaTorch's linear-size
  buffers (bottleneck BN, convolution outputs' gradients) are not reproduced.
- ``memory="checkpoint"``: the segment concat + BN + ReLU + first conv is run under
  :func:`torch.utils.checkpoint.checkpoint` (what torchvision and the authors' current code do);
  backward recomputes concat + BN + ReLU (torch stops once the conv's saved input is rebuilt).
- Section 4, ``memory="shared"``: two storages, allocated once per forward pass and used by every
  layer ("Shared Memory Storage 1 and 2", Fig 3 right), hold the concatenation and the BN+ReLU
  output of whichever layer runs; a custom :class:`torch.autograd.Function` saves only the layer's
  inputs (kept anyway) and re-populates the storages in backward before computing gradients.
  Gradient storage is not shared by hand: as the paper notes, PyTorch frees (and its allocator
  reuses) gradient buffers on its own. ``shared_buffer="max"`` is the paper's design, one pair of
  buffers of the largest size any layer needs, kept for the whole step; ``"per_block"`` (default)
  resizes the pair on entry to each dense block, so the deeper, narrower blocks hold less.

All forms hold the same modules, so their state dicts are interchangeable, and they compute the
same outputs, gradients and BatchNorm running statistics (the recomputation never advances the
running statistics a second time). Double backward (``create_graph=True``, e.g. a gradient
penalty) works in every form: the shared form's hand-written backward then falls back to
recomputing its segment with ordinary autograd ops, like the checkpoint form, and so holds that
segment's intermediates for the higher-order graph. Dropout is not implemented (DenseNet-BC on
augmented CIFAR/ImageNet uses none).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["FORMS", "SHARED_BUFFERS", "IMAGENET_BLOCKS", "DenseNet", "densenet_bc", "bc_depths"]

FORMS = ("naive", "luatorch", "checkpoint", "shared")
SHARED_BUFFERS = ("per_block", "max")
# Huang et al., Table 1 (ImageNet DenseNet-BC) plus the two deeper models of this paper. 161 is
# the k=48 model (28.7M parameters), 232 and 264 the models of Section 5 (k=32 or 48).
# NOTE: the paper's footnote 10 gives (6, 32, 64, 48) for 264 layers and (6, 32, 48, 48) for 232;
# those configurations have 305 and 273 layers and 41.3M / 90.5M / 71.5M parameters, far from the
# 33M, 73M and 55M it states. (6, 12, ...) matches both the depths and the parameter counts, so
# the "32" reads as a typo for "12".
IMAGENET_BLOCKS = {121: (6, 12, 24, 16), 161: (6, 12, 36, 24), 169: (6, 12, 32, 32),
                   201: (6, 12, 48, 32), 232: (6, 12, 48, 48), 264: (6, 12, 64, 48)}


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; need an int >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value}; must be >= {minimum}")
    return int(value)


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; allowed: {allowed}")
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")
    return value


def _check_form(memory: str) -> str:
    return _check_choice("memory", memory, FORMS)


def _bn_momentum(bn: nn.BatchNorm2d) -> float:
    """Advance ``num_batches_tracked`` and return the running-stat factor, as BatchNorm2d does."""
    if not (bn.training and bn.track_running_stats):
        return 0.0
    bn.num_batches_tracked.add_(1)
    return 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum


class _HeldBuffers:
    """The LuaTorch-style naive form's buffers: every layer's concatenation and BN output, and
    their gradients, kept alive until the step's autograd graph is freed.

    NOTE: one object per forward pass, referenced by the graph through tensor hooks, so it lives
    exactly as long as LuaTorch's per-module ``output``/``gradInput`` buffers matter for one step.
    Tensors are held detached (same storage, no autograd history) to avoid reference cycles
    between the graph and the hooks.
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def hold(self, *tensors: Tensor) -> None:
        self.tensors.extend(t.detach() for t in tensors)

    def hold_grad(self, grad: Tensor) -> None:
        self.tensors.append(grad.detach())


class _SharedStorage:
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


class _SharedConcatBNReLUConv(torch.autograd.Function):
    """conv(relu(bn(cat(features)))) writing the concat and BN output into shared storage."""

    @staticmethod
    def forward(ctx, storage, bn_weight, bn_bias, running_mean, running_var, conv_weight,
                training, momentum, eps, padding, *features):
        # NOTE: the segment runs in the parameters' dtype with autocast off: under autocast the
        # features arrive in half precision and are cast while copied into the storage; the
        # hand-written backward then never mixes dtypes (autograd casts the feature gradients
        # back). So under autocast conv1 is computed in full precision, unlike the naive form.
        with torch.autocast(features[0].device.type, enabled=False):
            return _SharedConcatBNReLUConv._forward(
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
            return _SharedConcatBNReLUConv._recompute_backward(
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


def _batch_norm(bn: nn.BatchNorm2d, x: Tensor, *, update_stats: bool) -> Tensor:
    if update_stats or not bn.training:
        return bn(x)
    # Recomputation in train mode: same batch statistics, running stats left alone.
    # NOTE: clones rather than None so the recomputed graph saves the same tensors as the
    # original forward (checkpoint's determinism check compares them).
    return F.batch_norm(x, bn.running_mean.clone(), bn.running_var.clone(), bn.weight, bn.bias,
                        True, 0.0, bn.eps)


class _DenseLayer(nn.Module):
    def __init__(self, in_channels: int, growth_rate: int, *, bottleneck: bool, bn_size: int,
                 memory: str) -> None:
        super().__init__()
        self.memory = memory
        self.bottleneck = bottleneck
        first_out = bn_size * growth_rate if bottleneck else growth_rate
        self.norm1 = nn.BatchNorm2d(in_channels)
        k1 = 1 if bottleneck else 3
        self.conv1 = nn.Conv2d(in_channels, first_out, k1, padding=k1 // 2, bias=False)
        if bottleneck:
            self.norm2 = nn.BatchNorm2d(first_out)
            self.conv2 = nn.Conv2d(first_out, growth_rate, 3, padding=1, bias=False)

    def _segment(self, features: list[Tensor], calls: list[int] | None = None,
                 held: _HeldBuffers | None = None) -> Tensor:
        """cat -> BN -> ReLU -> conv1, the part that grows with the number of inputs."""
        recompute = calls is not None and len(calls) > 0
        if calls is not None:
            calls.append(1)
        concat = torch.cat(features, 1)
        x = _batch_norm(self.norm1, concat, update_stats=not recompute)
        if held is not None:  # LuaTorch-style naive: both outputs and both gradients stay live
            held.hold(concat, x)
            for t in (concat, x):
                if t.requires_grad:
                    # NOTE: the hook on x fires with the gradient of the BN output (before the
                    # in-place ReLU), the one on concat with the concatenated-feature gradient
                    t.register_hook(held.hold_grad)
        return self.conv1(F.relu(x, inplace=True))

    def forward(self, features: list[Tensor],
                step: _SharedStorage | _HeldBuffers | None = None) -> Tensor:
        """`step` is the per-forward state: the shared storages, or the LuaTorch-style buffers."""
        if self.memory == "shared":
            bn = self.norm1
            storage = step if isinstance(step, _SharedStorage) else _SharedStorage()
            out = _SharedConcatBNReLUConv.apply(
                storage, bn.weight, bn.bias, bn.running_mean, bn.running_var, self.conv1.weight,
                bn.training, _bn_momentum(bn), bn.eps, self.conv1.padding[0], *features)
        elif (self.memory == "checkpoint" and torch.is_grad_enabled()
              and any(f.requires_grad for f in features)):
            # NOTE: `calls` tells the first (real) forward from the recomputation, so BN running
            # statistics advance once. No randomness in the segment: skip RNG bookkeeping.
            calls: list[int] = []
            out = checkpoint(lambda *fs: self._segment(list(fs), calls), *features,
                             use_reentrant=False, preserve_rng_state=False)
        elif self.memory == "luatorch":
            out = self._segment(features, held=step if isinstance(step, _HeldBuffers)
                                else _HeldBuffers())
        else:
            out = self._segment(features)
        if self.bottleneck:
            out = self.conv2(F.relu(self.norm2(out), inplace=True))
        return out


class _DenseBlock(nn.Module):
    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, *, bottleneck: bool,
                 bn_size: int, memory: str) -> None:
        super().__init__()
        self.growth_rate = growth_rate
        self.in_channels = in_channels
        self.layers = nn.ModuleList(
            _DenseLayer(in_channels + i * growth_rate, growth_rate, bottleneck=bottleneck,
                        bn_size=bn_size, memory=memory) for i in range(num_layers))

    def widest_numel(self, x_shape: tuple[int, ...]) -> int:
        """Elements of this block's widest concatenation for an input of shape `x_shape`."""
        n, _, h, w = x_shape
        return n * (self.in_channels + (len(self.layers) - 1) * self.growth_rate) * h * w

    def forward(self, x: Tensor, step: _SharedStorage | _HeldBuffers | None = None) -> Tensor:
        if isinstance(step, _SharedStorage) and step.per_block:
            # the widest concatenation of this block, reserved up front
            step.reserve(self.widest_numel(tuple(x.shape)), self.layers[0].norm1.weight,
                         exact=True)
        features = [x]
        for layer in self.layers:
            features.append(layer(features, step))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    """DenseNet(-BC) whose dense layers run in one of four memory forms (see module docstring).

    ``memory`` and ``shared_buffer`` can be changed after construction
    (``model.memory = "shared"``); parameters and buffers do not depend on them.
    """

    def __init__(self, growth_rate: int = 12, block_config: tuple[int, ...] = (16, 16, 16), *,
                 bottleneck: bool = True, compression: float = 0.5, num_classes: int = 10,
                 small_inputs: bool = True, memory: str = "naive", bn_size: int = 4,
                 num_init_features: int | None = None, in_channels: int = 3,
                 shared_buffer: str = "per_block") -> None:
        super().__init__()
        _check_form(memory)
        _check_choice("shared_buffer", shared_buffer, SHARED_BUFFERS)
        growth_rate = _check_int("growth_rate", growth_rate)
        if isinstance(block_config, (str, bytes)) or not hasattr(block_config, "__iter__"):
            raise TypeError(f"block_config={block_config!r}; need a sequence of ints >= 1")
        if not block_config:
            raise ValueError(f"block_config={block_config!r}; need >= 1 block of >= 1 layer")
        block_config = tuple(_check_int("block_config entry", n) for n in block_config)
        if isinstance(compression, bool) or not isinstance(compression, numbers.Real):
            raise TypeError(f"compression={compression!r}; need a number in (0, 1]")
        if not 0.0 < compression <= 1.0:
            raise ValueError(f"compression={compression}; must be in (0, 1]")
        num_classes = _check_int("num_classes", num_classes)
        bn_size = _check_int("bn_size", bn_size)
        in_channels = _check_int("in_channels", in_channels)
        for name, flag in (("bottleneck", bottleneck), ("small_inputs", small_inputs)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r}; need True or False")
        if num_init_features is None:
            num_init_features = 2 * growth_rate if (bottleneck and compression < 1) else 16
        num_init_features = _check_int("num_init_features", num_init_features)
        self.growth_rate, self.block_config = growth_rate, block_config
        self.small_inputs = small_inputs
        if small_inputs:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, num_init_features, 3, padding=1, bias=False))
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, num_init_features, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(num_init_features), nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1))
        self.blocks, self.transitions = nn.ModuleList(), nn.ModuleList()
        channels = num_init_features
        for i, num_layers in enumerate(self.block_config):
            self.blocks.append(_DenseBlock(num_layers, channels, growth_rate,
                                           bottleneck=bottleneck, bn_size=bn_size, memory=memory))
            channels += num_layers * growth_rate
            if i < len(self.block_config) - 1:
                out = int(math.floor(channels * compression))
                self.transitions.append(nn.Sequential(
                    nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                    nn.Conv2d(channels, out, 1, bias=False), nn.AvgPool2d(2, stride=2)))
                channels = out
        self.norm_final = nn.BatchNorm2d(channels)
        self.classifier = nn.Linear(channels, num_classes)
        self._memory = memory
        self._shared_buffer = shared_buffer
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    @property
    def memory(self) -> str:
        return self._memory

    @memory.setter
    def memory(self, value: str) -> None:
        self._memory = _check_form(value)
        for block in self.blocks:
            for layer in block.layers:
                layer.memory = value

    @property
    def shared_buffer(self) -> str:
        """``"per_block"`` (resize per dense block) or ``"max"`` (one largest-size pair, Section 4)."""
        return self._shared_buffer

    @shared_buffer.setter
    def shared_buffer(self, value: str) -> None:
        self._shared_buffer = _check_choice("shared_buffer", value, SHARED_BUFFERS)

    @property
    def depth(self) -> int:
        """Layers with weights: stem conv, dense-layer convs, transition convs, classifier.

        (Counted this way the ImageNet "264" configuration has 265; the name is conventional.)
        """
        per_layer = 2 if self.blocks[0].layers[0].bottleneck else 1
        return 1 + per_layer * sum(self.block_config) + len(self.transitions) + 1

    def _step_state(self, stem_out: Tensor) -> _SharedStorage | _HeldBuffers | None:
        if self._memory == "luatorch":
            return _HeldBuffers()
        if self._memory != "shared":
            return None
        storage = _SharedStorage(per_block=self._shared_buffer == "per_block")
        if not storage.per_block:
            # NOTE: every transition halves the maps (2x2 average pooling, floor), so block i sees
            # (h >> i, w >> i): the largest need over all blocks is known before the first one.
            n, _, h, w = stem_out.shape
            need = max(b.widest_numel((n, 0, h >> i, w >> i)) for i, b in enumerate(self.blocks))
            storage.reserve(need, self.blocks[0].layers[0].norm1.weight)
        return storage

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        step = self._step_state(x)
        for i, block in enumerate(self.blocks):
            x = block(x, step)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = F.relu(self.norm_final(x), inplace=True)
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def extra_repr(self) -> str:
        extra = f", shared_buffer={self._shared_buffer!r}" if self._memory == "shared" else ""
        return f"memory={self._memory!r}{extra}, depth={self.depth}, growth_rate={self.growth_rate}"


def bc_depths(max_depth: int, *, min_depth: int = 10) -> list[int]:
    """All CIFAR DenseNet-BC depths 6n+4 in [min_depth, max_depth]."""
    max_depth = _check_int("max_depth", max_depth, 0)
    min_depth = _check_int("min_depth", min_depth, 0)
    return [d for d in range(max(min_depth, 10), max_depth + 1) if (d - 4) % 6 == 0]


def densenet_bc(depth: int, growth_rate: int = 12, num_classes: int = 10, *,
                memory: str = "naive", imagenet: bool | None = None, **kwargs) -> DenseNet:
    """DenseNet-BC of a given depth.

    ``depth = 6n + 4`` (n >= 1) gives the 3-block CIFAR network with n bottleneck layers per
    block (depth 100 -> (16, 16, 16)); an ImageNet depth (121, 161, 169, 201, 232, 264) gives
    the 4-block ImageNet network with the 7x7 stem (the published models use growth_rate=32,
    or 48 for 161 and the 232/264-layer models of Pleiss et al.). ``imagenet=None`` picks the
    ImageNet network for those depths except 232, which is also a CIFAR depth (6 * 38 + 4):
    pass ``imagenet=True`` for the ImageNet 232. Other keywords go to :class:`DenseNet`.
    """
    depth = _check_int("depth", depth, 1)
    if imagenet is not None and not isinstance(imagenet, bool):
        raise TypeError(f"imagenet={imagenet!r}; need True, False or None")
    cifar = depth >= 10 and (depth - 4) % 6 == 0
    if imagenet is None:
        imagenet = depth in IMAGENET_BLOCKS and not cifar
    if imagenet:
        if depth not in IMAGENET_BLOCKS:
            raise ValueError(f"depth={depth} with imagenet=True; allowed: {sorted(IMAGENET_BLOCKS)}")
        kwargs.setdefault("small_inputs", False)
        blocks = IMAGENET_BLOCKS[depth]
    elif cifar:
        blocks = ((depth - 4) // 6,) * 3
    else:
        raise ValueError(f"depth={depth}; allowed: 6n+4 with n >= 1 (10, 16, ..., 100, ...) "
                         f"or an ImageNet depth {sorted(IMAGENET_BLOCKS)}")
    return DenseNet(growth_rate, blocks, num_classes=num_classes, memory=memory, **kwargs)

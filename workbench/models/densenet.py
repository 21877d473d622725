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
  output of whichever layer runs; a custom :class:`torch.autograd.Function`
  (``workbench.models.densenet_shared``) saves only the layer's inputs (kept anyway) and
  re-populates the storages in backward before computing gradients.
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

from .densenet_shared import SharedConcatBNReLUConv, SharedStorage, bn_momentum

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
                step: SharedStorage | _HeldBuffers | None = None) -> Tensor:
        """`step` is the per-forward state: the shared storages, or the LuaTorch-style buffers."""
        if self.memory == "shared":
            bn = self.norm1
            storage = step if isinstance(step, SharedStorage) else SharedStorage()
            out = SharedConcatBNReLUConv.apply(
                storage, bn.weight, bn.bias, bn.running_mean, bn.running_var, self.conv1.weight,
                bn.training, bn_momentum(bn), bn.eps, self.conv1.padding[0], *features)
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

    def forward(self, x: Tensor, step: SharedStorage | _HeldBuffers | None = None) -> Tensor:
        if isinstance(step, SharedStorage) and step.per_block:
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

    def _step_state(self, stem_out: Tensor) -> SharedStorage | _HeldBuffers | None:
        if self._memory == "luatorch":
            return _HeldBuffers()
        if self._memory != "shared":
            return None
        storage = SharedStorage(per_block=self._shared_buffer == "per_block")
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

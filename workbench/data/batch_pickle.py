"""Reading a CIFAR python batch (a pickle) without trusting it: what `readers.load_cifar10/100` load.

A pickle names the callables that rebuild it, so `pickle.load` of a data file runs whatever the file asks for.
A file is first scanned opcode by opcode (`pickletools.genops`, nothing executed): lengths must fit in the file,
memo indices must be ones a pickler writes, the opcodes that construct arbitrary objects are refused, and
containers may nest at most MAX_NESTING deep. It then loads through an unpickler that admits only the numpy
helpers real batches name, charging every array and byte string it builds to a budget of twice the file's size.
"""

from __future__ import annotations

import math
import pickle
import pickletools
from pathlib import Path

import numpy as np

__all__ = ["MAX_NESTING", "MAX_PICKLE_BYTES", "read_batch"]

MAX_PICKLE_BYTES = 512 * 2**20  # largest CIFAR file a reader accepts (CIFAR-100 `train` is ~155 MB)
MAX_NESTING = 100  # deepest nest of containers a CIFAR file may build (a real batch: 5, its arrays counted)
_LATIN1 = {"latin1", "latin-1", "iso-8859-1", "iso8859-1", "l1"}
# Opcodes that build objects by calling classes, or fetch them from outside the file; CIFAR batches
# (dicts of arrays, lists, bytes, str and ints under protocols 2-5) use none of them.
_REFUSED_OPS = {"INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4",
                "NEXT_BUFFER", "READONLY_BUFFER"}


class _Refused(pickle.UnpicklingError):
    """A file asked for something a CIFAR batch never holds (the message says what)."""


class _CappedReader:
    """A binary file that reads no further than `size` bytes, whatever length a caller asks for.

    # NOTE: a pickle's length fields are input; io's read(n) allocates n bytes before reading, so
    # lengths are clamped to what the file can still hold.
    """

    def __init__(self, file, size: int) -> None:
        self.file, self.left = file, size

    def read(self, n: int = -1) -> bytes:
        data = self.file.read(self.left if n is None or n < 0 else min(n, self.left))
        self.left -= len(data)
        return data

    def readline(self) -> bytes:
        data = self.file.readline(self.left)
        self.left -= len(data)
        return data


_BUILDS = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET", "REDUCE", "EMPTY_TUPLE",
           "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"}  # push a container one level above what they take
_ADDS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}  # add to the container below them


class _Nesting:
    """How deep the objects a pickle builds nest, followed opcode by opcode on a stack of depths.

    # NOTE: Python hashes a tuple by hashing its items with no recursion limit, so a dict key nested
    # 200,000 tuples deep (a 200 KB file of opcodes the scan allows) overflowed the C stack: a
    # segmentation fault, not an exception. Depths are counted before anything is built. A list changed
    # after it was memoized is counted at its memoized depth; lists are unhashable and their repr and
    # comparisons stop at Python's recursion limit, so only immutable nests need the exact count.
    """

    def __init__(self) -> None:
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.deepest = 0

    def step(self, op, arg) -> int:
        """Apply opcode `op`; the deepest nest built so far."""
        name, before = op.name, op.stack_before
        items: list[int] = []
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):  # the top of the stack, left there
            self.memo[int(arg)] = self.stack[-1]
            return self.deepest
        if name == "POP" and not self.stack and self.marks:  # as pickle's own POP: an empty stack pops the mark
            self.marks.pop()
            return self.deepest
        if pickletools.markobject in before:
            start = self.marks.pop()
            items, self.stack[start:] = self.stack[start:], []
            plain = before.index(pickletools.markobject)
        else:
            plain = len(before)
        if plain > len(self.stack):
            raise ValueError(f"opcode {name} finds {len(self.stack)} objects on the stack, needs {plain}")
        popped = self.stack[len(self.stack) - plain:] if plain else []
        del self.stack[len(self.stack) - plain:]
        if name == "MARK":
            self.marks.append(len(self.stack))
            return self.deepest
        if not op.stack_after:  # POP, POP_MARK, STOP
            return self.deepest
        if name == "MEMOIZE":
            self.memo[len(self.memo)] = popped[0]
            pushed = popped
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed = [self.memo.get(int(arg), 0)]
        elif name == "DUP":
            pushed = popped * 2
        elif name in _ADDS:
            pushed = [max(popped[0], 1 + max(items + popped[1:], default=0))]
        elif name in _BUILDS:
            pushed = [1 + max(items + popped, default=0)]
        else:  # a number, a string, bytes, a global name: no nesting of its own
            pushed = [max(items + popped, default=0)] * len(op.stack_after)
        self.stack += pushed
        self.deepest = max(self.deepest, *pushed, 0)
        return self.deepest


def _prescan(reader: _CappedReader) -> None:
    """Walk the opcodes without executing them; refuse what a pickler of plain data never writes, and
    containers nested deeper than MAX_NESTING."""
    ops, nesting = 0, _Nesting()
    for ops, (op, arg, _) in enumerate(pickletools.genops(reader), start=1):
        if op.name in _REFUSED_OPS:
            raise _Refused(f"refused opcode {op.name}; a CIFAR batch holds only plain data and numpy arrays")
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and not 0 <= int(arg) <= ops:
            raise _Refused(f"memo index {arg} at opcode {ops} (a pickler numbers them 0, 1, 2, ...)")
        if op.name == "FRAME" and arg > reader.left:
            raise ValueError(f"frame of {arg} bytes, but only {reader.left} bytes remain")
        if nesting.step(op, arg) > MAX_NESTING:
            raise _Refused(f"objects nested more than MAX_NESTING={MAX_NESTING} levels deep (at opcode {ops}, "
                           f"{op.name}); a CIFAR batch nests 5")


class _Dtype:
    """Stands in for numpy.dtype while unpickling: a plain bool/int/uint/float dtype, nothing else."""

    def __init__(self, spec, align=False, copy=True) -> None:
        if not isinstance(spec, (str, bytes)) or len(spec) > 8:
            raise _Refused(f"refused dtype {str(spec)[:80]}; CIFAR arrays hold plain numbers")
        try:
            dtype = np.dtype(spec.decode("latin1") if isinstance(spec, bytes) else spec)
        except (TypeError, ValueError):
            raise _Refused(f"refused dtype {spec!r}") from None
        if dtype.kind not in "biuf" or dtype.fields or dtype.subdtype:
            raise _Refused(f"refused dtype {spec!r}; CIFAR arrays hold plain numbers")
        self.dtype = dtype

    def __setstate__(self, state) -> None:  # (version, byte order, subarray, names, fields, ...)
        if not isinstance(state, tuple) or len(state) < 5 or state[1] not in ("<", ">", "|", "=") \
                or any(part is not None for part in state[2:5]):
            raise _Refused(f"refused dtype state {str(state)[:80]}")
        if state[1] in "<>":
            self.dtype = self.dtype.newbyteorder(state[1])


class _NdarrayName:
    """What the name numpy.ndarray resolves to: usable only as `_reconstruct`'s first argument."""

    def __new__(cls, *args, **kwargs):
        raise _Refused("refused to call numpy.ndarray directly; arrays are rebuilt only by numpy's "
                       "_reconstruct or _frombuffer, as in real batches")


class _BatchUnpickler(pickle.Unpickler):
    """Admits numpy array reconstruction and latin-1 bytes, each charged to a byte budget; nothing else.

    # NOTE: `pickle.load` calls any importable callable a file names (`os.system` included); a data
    # file is input, so only the numpy helpers the real CIFAR batches use are admitted, and each is
    # replaced by a checked version that sizes what it will allocate before allocating it.
    """

    def __init__(self, file, budget: int) -> None:
        super().__init__(file, encoding="latin1")
        self.budget = self.left = budget
        unpickler = self

        class _Array(np.ndarray):
            def __setstate__(self, state) -> None:
                unpickler._set_array(self, state)

        self.array_type = _Array
        names = {"multiarray._reconstruct": self._reconstruct, "multiarray.scalar": self._scalar,
                 "numeric._frombuffer": self._frombuffer}
        self.allowed = {("numpy", "ndarray"): _NdarrayName, ("numpy", "dtype"): _Dtype,
                        ("_codecs", "encode"): self._encode}
        for package in ("numpy.core", "numpy._core"):  # files written under numpy 1 and numpy 2
            for name, helper in names.items():
                module, attr = f"{package}.{name}".rsplit(".", 1)
                self.allowed[(module, attr)] = helper

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise _Refused(f"refused to load {module}.{name}; a CIFAR batch holds only dicts, lists, "
                           f"bytes, str, ints and numpy arrays") from None

    def _charge(self, nbytes: int, what: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise _Refused(f"{what} would take the bytes built past {self.budget:,} (twice the file's size "
                           f"plus 1 MiB); a real batch builds about its own size")

    def _size(self, shape, dtype) -> tuple[tuple[int, ...], np.dtype, int]:
        if not isinstance(dtype, _Dtype):
            raise _Refused(f"refused array dtype {type(dtype).__name__}")
        if not isinstance(shape, tuple) or not all(type(d) is int and 0 <= d < 2**40 for d in shape):
            raise _Refused(f"refused array shape {str(shape)[:80]}")
        return shape, dtype.dtype, math.prod(shape) * dtype.dtype.itemsize

    def _reconstruct(self, cls, shape, dtype):
        if cls is not _NdarrayName:
            raise _Refused(f"refused to reconstruct {getattr(cls, '__name__', cls)!r}; only numpy.ndarray")
        shape, dtype, nbytes = self._size(shape, _Dtype(dtype))
        self._charge(nbytes, f"an empty array of shape {shape}")
        return np.ndarray.__new__(self.array_type, shape, dtype)

    def _set_array(self, array: np.ndarray, state) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise _Refused("refused array state")
        shape, dtype, nbytes = self._size(*state[-4:-2])
        fortran, raw = state[-2:]
        self._charge(nbytes, f"an array of shape {shape}")
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != nbytes:
            raise _Refused(f"array of shape {shape} needs {nbytes} bytes of data, got {type(raw).__name__}")
        np.ndarray.__setstate__(array, (1, shape, dtype, bool(fortran), raw))

    def _frombuffer(self, buffer, dtype, shape, order):
        shape, dtype, nbytes = self._size(shape, dtype)
        self._charge(nbytes, f"an array of shape {shape}")
        if not isinstance(buffer, (bytes, bytearray)) or len(buffer) != nbytes or order not in ("C", "F"):
            raise _Refused(f"array of shape {shape} needs {nbytes} bytes of data in order C or F")
        return np.frombuffer(buffer, dtype).reshape(shape, order=order)

    def _scalar(self, dtype, raw):
        _, dtype, nbytes = self._size((), dtype)
        self._charge(nbytes, "a numpy scalar")
        if not isinstance(raw, bytes) or len(raw) != nbytes:
            raise _Refused(f"a {dtype} scalar needs {nbytes} bytes")
        return np.frombuffer(raw, dtype)[0]

    def _encode(self, text, encoding="utf-8", errors="strict"):
        if not isinstance(text, str) or encoding not in _LATIN1:
            raise _Refused(f"refused _codecs.encode(..., {encoding!r}); only latin-1 text")
        self._charge(len(text), "latin-1 bytes")
        return text.encode("latin1")


def read_batch(path: Path) -> dict:
    """The dict a CIFAR python batch file holds, keys as text; ValueError naming the file when it is not one."""
    size = path.stat().st_size
    if not path.is_file() or size > MAX_PICKLE_BYTES:
        raise ValueError(f"{path}: not a CIFAR python batch ({size:,} bytes; a regular file of at most "
                         f"MAX_PICKLE_BYTES={MAX_PICKLE_BYTES:,} bytes is accepted)")
    try:
        with open(path, "rb") as f:
            _prescan(_CappedReader(f, size))
            f.seek(0)
            batch = _BatchUnpickler(_CappedReader(f, size), 2 * size + 2**20).load()
    except _Refused as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, MemoryError, UnicodeDecodeError, RecursionError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{path}: not a CIFAR python batch (truncated or corrupt: {problem})") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a CIFAR batch (a dict with 'data' and labels), got {type(batch).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}

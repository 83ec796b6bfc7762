"""Permissive import stubs for the GPU stack, so sglang 0.5.23's disaggregation classes import on
a CPU-only machine without torch/triton.

Only modules whose top-level name is in STUBBED are faked. Every attribute of a stub module is a
`Stub`: callable (returns a Stub, or the wrapped function when used as a bare decorator),
subclassable, indexable, iterable (empty), falsy, comparable. Nothing sglang's transfer path
executes depends on these values: KV pools and aux buffers are numpy arrays, and the engine is
Mooncake TE.
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import sys
import types

# Top-level module names replaced by stubs (GPU stack only).
STUBBED = {
    "torch",
    "triton",
    "torchvision",
    "torchaudio",
    "flashinfer",
    "sgl_kernel",
    "vllm",
    "cuda",
    "pynvml",
    "amdsmi",
    "deep_gemm",
    "deep_ep",
    "xformers",
    "tvm_ffi",
    "compressed_tensors",  # torch-only quantization library (requires torch)
}


# Attributes that must be absent (sglang probes them with hasattr to pick a platform).
ABSENT = {
    "torch": {"npu"},
}


class _StubMeta(abc.ABCMeta):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class _Permissive:
    """Answers every use permissively."""

    def __init__(self, *args, **kwargs):
        name = args[0] if args and isinstance(args[0], str) else type(self).__name__
        object.__setattr__(self, "_stub_name", name)

    def __repr__(self):
        return f"<stub {object.__getattribute__(self, '_stub_name')}>"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub(f"{object.__getattribute__(self, '_stub_name')}.{name}")

    def __call__(self, *args, **kwargs):
        # bare decorator: @torch.compile / @triton.jit / @torch.no_grad()
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Permissive):
            return args[0]
        return Stub(f"{object.__getattribute__(self, '_stub_name')}()")

    # subclassing a Stub instance (class Foo(torch.nn.Module)) -> a StubBase subclass
    def __mro_entries__(self, bases):
        return (StubBase,)

    def __getitem__(self, item):
        return Stub(f"{object.__getattribute__(self, '_stub_name')}[]")

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __or__(self, other):
        return self

    __ror__ = __and__ = __rand__ = __add__ = __radd__ = __sub__ = __mul__ = __rmul__ = __or__
    __truediv__ = __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __rsub__ = __or__
    __xor__ = __lshift__ = __rshift__ = __matmul__ = __or__

    def __neg__(self):
        return self

    __pos__ = __abs__ = __invert__ = __neg__

    def __contains__(self, item):
        return False



class StubBase(_Permissive, metaclass=_StubMeta):
    """What `class Foo(torch.nn.Module, ABC)` derives from."""


class Stub(_Permissive):
    """The value of every attribute of a stub module."""

    # isinstance(x, torch.Tensor) / issubclass(T, nn.Module): nothing real is a stub
    def __instancecheck__(self, obj):
        return False

    def __subclasscheck__(self, cls):
        return False


class StubModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []  # a package: submodules import too
        self.__file__ = f"<kvx stub {name}>"
        self.__version__ = "0.0.0+kvxstub"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name in ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value = Stub(full)
        setattr(self, name, value)
        return value


class dtype:
    """torch.dtype: real instances, so isinstance checks and pydantic validators pass."""

    def __init__(self, name, itemsize):
        self.name = name
        self.itemsize = itemsize
        self.is_floating_point = "float" in name

    def __repr__(self):
        return f"torch.{self.name}"

    def to_real(self):
        return None


_DTYPES = {
    "float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2,
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int": 4, "int64": 8, "long": 8, "bool": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "complex64": 8,
}


class Tensor(StubBase):
    """torch.Tensor: a class, never instantiated by the transfer path."""


class Library(StubBase):
    """torch.library.Library: keeps its name (sglang reads `lib.m.name`)."""

    def __init__(self, name, *args, **kwargs):
        self.m = types.SimpleNamespace(name=name)


def _populate(module):
    if module.__name__ == "torch.library":
        module.Library = Library
    if module.__name__ == "torch":
        module.__version__ = "2.14.1"  # what sglang 0.5.23 pins
        # no accelerator toolkit: is_hip()/is_cuda()/is_musa() are False
        module.version = types.SimpleNamespace(
            __version__="2.14.1", cuda=None, hip=None, musa=None, git_version="kvxstub"
        )
        module.dtype = dtype
        module.Tensor = Tensor
        for name, size in _DTYPES.items():
            setattr(module, name, dtype(name, size))


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        _populate(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


def install():
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

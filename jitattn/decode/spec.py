"""DecodeSpec: what a single-decode kernel is compiled for, and the rule that picks it for a call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jitattn.jit.registry import register
from jitattn.jit.spec import DTYPE_TAGS, KernelSpec, check_field

TENSOR_CORE_MIN_GROUP = 4  # GQA groups this large run on tensor cores by default (DecodeSpec.for_call)
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
MAX_GROUP_SIZE = 1024  # the `group_size` shorthand's bound (a GQA group: num_qo_heads // num_kv_heads)


@register
@dataclass(frozen=True)
class DecodeSpec(KernelSpec):
    """single_decode_with_kv_cache: one query token per head, split-KV over the sequence."""

    family: ClassVar[str] = "decode"
    shorthands: ClassVar[tuple[str, ...]] = ("group_size",)  # the GQA group: from_fields resolves it
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "decode/binding.cpp.j2",
        "kernels.cu": "decode/kernels.cu.j2",
    }

    head_dim: int
    dtype_q: str = "float16"
    dtype_kv: str = "float16"
    pos_encoding: str = "NONE"  # NONE | ROPE_LLAMA | ALIBI
    soft_cap: bool = False
    group_tile: int = 1  # query heads of one GQA group handled per CTA (1..8; up to 16 with tensor cores)
    tensor_cores: bool = False  # mma.sync path: the group's query heads are the MMA's rows

    choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "dtype_q": ("float16", "bfloat16"), "dtype_kv": tuple(DTYPE_TAGS), "pos_encoding": POS_ENCODINGS}
    ranges: ClassVar[dict[str, tuple[int, int]]] = {"head_dim": (32, 256), "group_tile": (1, 16)}
    rules: ClassVar[dict[str, str]] = {"head_dim": "a multiple of 16 in [32, 256]"}

    def __post_init__(self):
        """The shapes templates/decode/kernels.cu.j2 static_asserts (and the API's checks)."""
        self.validate_fields()
        if self.head_dim % 16:
            raise ValueError(f"decode spec field head_dim must be a multiple of 16 in [32, 256] (whole 16-byte "
                             f"vectors), got {self.head_dim}")
        if self.dtype_kv in FP8_DTYPES and self.head_dim % 32:
            raise ValueError(f"decode spec field head_dim must be a multiple of 32 with fp8 dtype_kv, got {self.head_dim}")
        if self.tensor_cores and self.head_dim % 32:
            raise ValueError(f"decode tensor_cores=true needs head_dim a multiple of 32, got {self.head_dim}")
        if not self.tensor_cores and self.group_tile > 8:
            raise ValueError(f"decode group_tile must be in [1, 8] without tensor cores (up to 16 with "
                             f"tensor_cores=true), got {self.group_tile}")

    @staticmethod
    def group_tile_for(group_size: int, dtype_kv: str = "float16") -> int:
        """Query heads per CTA for a GQA group: the group rounded up to a power of two, at most 8
        (4 with fp8 KV, whose threads hold twice the elements); larger groups take several CTAs
        per KV head."""
        limit = 4 if dtype_kv.startswith("float8") else 8
        return min(limit, 1 << (group_size - 1).bit_length())

    @staticmethod
    def tensor_core_group_tile(group_size: int) -> int:
        """Query heads per CTA on the tensor-core path: up to the MMA's 16 rows."""
        return min(16, 1 << (group_size - 1).bit_length())

    @classmethod
    def for_call(cls, head_dim: int, dtype_q: str, dtype_kv: str, pos_encoding: str, soft_cap: bool,
                 group_size: int, use_tensor_cores: bool = False) -> "DecodeSpec":
        """The specialization a call runs (single_decode_with_kv_cache and manifests' group_size
        both ask here).

        Tensor cores when asked for, and also where they measured faster: GQA groups of
        TENSOR_CORE_MIN_GROUP or more (the CUDA-core kernel is compute-bound there, fp8 K/V even
        more so), and RoPE with 16-bit K/V (K rotated in registers); fp8 MHA stays on CUDA cores.
        Never with a head_dim that is not a multiple of 32 (the CUDA-core kernel, same results).
        Why: notes/decode-h200.md, "DecodeSpec.for_call"."""
        fp8 = dtype_kv.startswith("float8")
        tensor_cores = head_dim % 32 == 0 and (use_tensor_cores or group_size >= TENSOR_CORE_MIN_GROUP
                                               or (pos_encoding == "ROPE_LLAMA" and not fp8))
        tile = cls.tensor_core_group_tile(group_size) if tensor_cores else cls.group_tile_for(group_size, dtype_kv)
        return cls(head_dim, dtype_q, dtype_kv, pos_encoding, soft_cap, tile, tensor_cores)

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """Without a group (size or tile), the kernel an MHA call (group 1) runs: through
        `for_call`, so RoPE or tensor cores pick the kernel a call would."""
        if "group_size" not in fields and "group_tile" not in fields:
            fields = {**fields, "group_size": 1}
        return [fields]

    @classmethod
    def from_fields(cls, data: dict) -> "DecodeSpec":
        """dtype_kv defaults to dtype_q; a `group_size` (manifests may name the GQA group) becomes
        the group tile and tensor-core choice that a call of that group would run."""
        data = dict(cls.check_fields(data))
        data.setdefault("dtype_kv", data.get("dtype_q", "float16"))
        if "group_size" not in data:
            return super().from_fields(data)
        group_size = check_field(cls.family, "group_size", data.pop("group_size"), int, (1, MAX_GROUP_SIZE))
        if "group_tile" in data:
            raise ValueError("decode spec: give group_size (the GQA group) or group_tile (the heads a CTA "
                             "takes), not both")
        ask = check_field(cls.family, "tensor_cores", data.pop("tensor_cores", False), bool)
        fields = super().from_fields(data)  # every other field checked before for_call computes with them
        call = cls.for_call(fields.head_dim, fields.dtype_q, fields.dtype_kv, fields.pos_encoding, fields.soft_cap,
                            group_size, ask)
        return super().from_fields({**data, "group_tile": call.group_tile, "tensor_cores": call.tensor_cores})

    @property
    def name(self) -> str:
        return (
            f"decode_{DTYPE_TAGS[self.dtype_q]}_kv{DTYPE_TAGS[self.dtype_kv]}_d{self.head_dim}"
            f"_pos{self.pos_encoding.lower().replace('_', '')}_cap{int(self.soft_cap)}"
            f"_g{self.group_tile}{'_tc' if self.tensor_cores else ''}"
        )

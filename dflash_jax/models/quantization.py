"""Quantized targets: block-FP8 checkpoints as they ship, int8 weight-only quantization.

Two formats are read (`parse_quantization_config`, from config.json's `quantization_config`,
checked before any weight is read; anything else is one line naming it):

  quant_method "fp8" (Qwen3-*-FP8 and the like): every decoder linear stores `weight` in
    float8_e4m3fn [out, in] and `weight_scale_inv` [ceil(out/b0), ceil(in/b1)] for
    `weight_block_size` [b0, b1]; w = fp8 * weight_scale_inv of its block (a multiply, despite
    the name); the scales' dtype is the file's. Embeddings, norms and the LM head are plain
    tensors. Weight-only semantics: the dequantized weights times activations in the compute
    dtype (activation_scheme "dynamic", i.e. no activation scales in the file).
  quant_method "dflash_int8" (what `save_target` writes for an int8 target; our own names,
    close to compressed-tensors' int-quantized channel scheme): each quantized linear stores
    `weight` int8 [out, in] and `weight_scale` float32 [out]; w = weight * weight_scale[:, None].
    `quantization_config`: {"quant_method": "dflash_int8", "bits": 8, "symmetric": true,
    "granularity": "per_output_channel", "lm_head": <bool>}.

FP8 design: dequantized at load into the parameter dtype. TPU v5e/v6e have no FP8 matmul and
XLA:CPU none either, so FP8 is a storage format there; dequantizing at load is the simplest
correct reading (one multiply per block, once), and `quantize="int8"` on top of it requantizes
the dequantized weights per output channel, which gives the halved bytes per step that keeping
FP8 on device would have given, through the same int8 matmul path as any other target.

int8 design: a small module of our own (`layers.Int8Dense`), not google/qwix. The project needs
exactly one scheme (symmetric int8 per output channel, weight-only) on a fixed set of Flax
Linen Dense layers whose parameter names the checkpoint code, the sharding rules and the HBM
model address by path. qwix would add a dependency (not installed here, and no hub access to
try it), rewrite modules by interception rules and produce its own parameter tree layout, which
every one of those places would have to learn; ~40 lines of our own keep the tree plain
(`kernel` int8 [in, out] + `kernel_scale` float32 [out]) and the matmul explicit:
`(x @ kernel.astype(dtype)) * scale`, which XLA fuses (the convert inside the dot's fusion,
checked in tests/test_quantized.py), so the int8 bytes are what is read from memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import numpy as np

INT8_METHOD = "dflash_int8"
QUANTIZE_CHOICES = ("int8",)
# The decoder linears that int8 quantization covers (the LM head on request).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's `quantization_config` says: method "fp8" (block_size [b0, b1]) or
    "dflash_int8" (lm_head: whether the LM head is quantized too)."""

    method: str
    block_size: Tuple[int, int] = (128, 128)
    lm_head: bool = False


def parse_quantization_config(hf: dict, source: str = "config.json") -> Optional[QuantSpec]:
    """The checked quantization of a config.json dict (None: not quantized). An unsupported
    quant_method, fmt, activation scheme, block size or bit width is one ValueError naming it."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(
            f"{source}: quantization_config must be an object, got {type(qc).__name__}"
        )
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"{source}: unsupported fp8 quantization fmt {fmt!r}; supported: 'e4m3'"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"{source}: unsupported fp8 activation_scheme {scheme!r}; supported: "
                "'dynamic' (weight-only: activations stay in the compute dtype)"
            )
        block = qc.get("weight_block_size")
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
        ):
            raise ValueError(
                f"{source}: fp8 weight_block_size must be two positive integers [out, in], "
                f"got {block!r} (per-tensor FP8 is not supported)"
            )
        return QuantSpec("fp8", block_size=(int(block[0]), int(block[1])))
    if method == INT8_METHOD:
        bits = qc.get("bits")
        if bits != 8:
            raise ValueError(
                f"{source}: unsupported {INT8_METHOD} bit width {bits!r}; supported: 8"
            )
        lm_head = qc.get("lm_head", False)
        if not isinstance(lm_head, bool):
            raise ValueError(f"{source}: quantization_config.lm_head must be true or false")
        return QuantSpec(INT8_METHOD, lm_head=lm_head)
    raise ValueError(
        f"{source}: unsupported quantization_config.quant_method {method!r}; supported: "
        f"'fp8' (block-wise e4m3), {INT8_METHOD!r} (per-channel int8, as save_target writes)"
    )


def check_quantize(quantize: Optional[str]) -> Optional[str]:
    """`quantize` of load_target / infer.py: None or "int8"; anything else one line."""
    if quantize is None or quantize == "" or quantize == "none":
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(
            f"quantize={quantize!r} is not supported; supported: {', '.join(QUANTIZE_CHOICES)} "
            "(weight-only, per output channel)"
        )
    return quantize


def quantization_config(lm_head: bool) -> dict:
    """The config.json `quantization_config` that `save_target` writes for an int8 target."""
    return {
        "quant_method": INT8_METHOD,
        "bits": 8,
        "symmetric": True,
        "granularity": "per_output_channel",
        "lm_head": bool(lm_head),
    }


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """float32 [out, in] = weight (float8_e4m3fn [out, in]) times its block's scale
    (scale_inv [ceil(out/b0), ceil(in/b1)]); the last blocks of each axis may be ragged."""
    out_dim, in_dim = weight.shape
    b0, b1 = block
    want = (math.ceil(out_dim / b0), math.ceil(in_dim / b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)}, expected {want}")
    s = np.asarray(scale_inv, np.float32)
    s = np.repeat(np.repeat(s, b0, axis=0), b1, axis=1)[:out_dim, :in_dim]
    return np.asarray(weight, np.float32) * s


def quantize_int8(kernel_in_out: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column of a Flax kernel [in, out]: (int8 [in, out], float32
    scale [out]) with scale = max|w| / 127 over the column (1 for an all-zero column) and
    w ~= q * scale."""
    w = np.asarray(kernel_in_out, np.float32)
    amax = np.max(np.abs(w), axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale

"""Absolute throughput of a timed step: model FLOPs (MaxText's convention), tokens/s, TFLOP/s and MFU.

:func:`model_flops_per_step` is the one place the bench counts model FLOPs; :func:`peak_bf16_tflops`
looks up the device's published dense bf16 peak (``None`` where none is known: no MFU, never a
guess); :func:`throughput_fields` turns a measured step time into the CSV columns.
"""

from __future__ import annotations

import re

from jremat.models import ModelConfig

#: Published dense (no sparsity) bf16 peak per device, TFLOP/s, keyed by a regular expression
#: searched (case-insensitively) in ``jax.devices()[0].device_kind``; the first match wins. A
#: ``None`` peak marks a kind known to differ from the broader entry after it (other clocks) whose
#: figure the bench does not carry: it gets no MFU rather than the wrong one.
PEAK_BF16_TFLOPS: tuple[tuple[str, float | None], ...] = (
    (r"H100 PCIe", 756.0),  # "NVIDIA H100 PCIe"
    (r"H[12]00 NVL", None),  # NVL cards run other clocks
    (r"GH200|H100|H200", 989.4),  # "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H200", "NVIDIA GH200 480GB"
    (r"A100", 312.0),  # SXM4 and PCIe, 40 and 80 GB alike
    (r"\bL4\b", 121.0),  # "NVIDIA L4" (not the L40 / L40S)
    (r"^TPU v4$", 275.0),  # not "TPU v4 lite" (v4i)
    (r"^TPU v5( lite|e)$", 197.0),  # v5e
    (r"^TPU v5p?$", 459.0),  # v5p (JAX names it "TPU v5")
    (r"^TPU v6( lite|e)$", 918.0),  # v6e (Trillium)
)


def peak_bf16_tflops(device_kind: str) -> float | None:
    """The published dense bf16 peak of a device, TFLOP/s, or ``None`` when the bench knows none.

    Args:
      device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"`` or ``"cpu"``.

    Returns:
      The first :data:`PEAK_BF16_TFLOPS` entry whose pattern occurs in ``device_kind``; ``None`` for
      a device with no entry (every CPU) or an entry without a figure.
    """
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_kind.strip(), flags=re.IGNORECASE):
            return peak
    return None


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights that enter a matmul once per token: per block q, k, v, out and both MLP layers, plus the head.

    Not counted (they do no matmul): the token and position embedding lookups, biases, LayerNorm
    scales and offsets. The vocabulary head is counted (``d_model * vocab_size``; the model's
    head is untied from the token embedding). In an MoE block (``moe_experts > 0``) a token's
    weights are the router's and those of its ``moe_top_k`` experts (and of the shared expert),
    not every expert's.
    """
    inner = cfg.n_heads * cfg.head_dim
    mlp = 2 * cfg.d_model * cfg.d_ff
    if cfg.moe_experts:
        expert = 3 * cfg.d_model * cfg.d_ff  # SwiGLU: gate, up and down projections
        mlp = cfg.d_model * cfg.moe_experts + cfg.moe_top_k * expert + int(cfg.moe_shared_expert) * mlp
    per_block = 4 * cfg.d_model * inner + mlp
    return cfg.n_layers * per_block + cfg.d_model * cfg.vocab_size


def model_flops_per_step(cfg: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward) of ``GPT(cfg)`` on ``batch_size x seq_len`` tokens.

    MaxText's convention (``calculate_tflops_training_per_device`` in ``MaxText/maxtext_utils.py``,
    after PaLM, arXiv:2204.02311 appendix B), per token:

    * weights: ``6 * N`` with ``N`` = :func:`matmul_parameters` (a matmul costs 2 FLOPs per weight
      and token forward, 4 backward: the input's and the weight's gradient);
    * causal attention: ``6 * n_layers * seq_len * n_heads * head_dim``. Forward, ``Q K^T`` and
      ``P V`` each cost ``2 * seq * head_dim`` FLOPs per query token and head (``4 * seq * H * D``
      per token and layer); causality halves it (``2 * seq * H * D``); backward is twice the
      forward, so the step is 3x: ``6 * seq * H * D`` per layer.

    Only the model's FLOPs count: recomputation (remat, a fused attention's backward) is not
    counted, and neither are the softmax, LayerNorms, the loss or the optimizer update. The
    causal halving applies whatever the attention implementation computes (``explicit`` computes
    the masked half too). The bench's steps run on one device, so this is also per device.

    Returns:
      ``batch_size * seq_len * (6 * N + 6 * n_layers * seq_len * n_heads * head_dim)``.
    """
    weights = 6 * matmul_parameters(cfg)
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return float(batch_size * seq_len * (weights + attention))


def throughput_fields(
    cfg: ModelConfig, batch_size: int, seq_len: int, step_s: float, peak_tflops: float | None
) -> dict:
    """The CSV throughput columns of a step that took ``step_s`` seconds.

    Args:
      cfg: the model (its shapes give the model FLOPs).
      batch_size, seq_len: the step's tokens.
      step_s: the measured step time in seconds.
      peak_tflops: the device's dense bf16 peak (:func:`peak_bf16_tflops`), or ``None``.

    Returns:
      ``step_s``, ``tokens_per_s`` (``batch * seq / step_s``), ``model_flops`` (per step),
      ``model_tflops_per_s`` (per device), ``peak_bf16_tflops`` and ``mfu`` (a fraction; both
      ``""`` when the peak is unknown).
    """
    flops = model_flops_per_step(cfg, batch_size, seq_len)
    achieved = flops / step_s / 1e12
    return dict(
        step_s=step_s,
        tokens_per_s=batch_size * seq_len / step_s,
        model_flops=flops,
        model_tflops_per_s=achieved,
        peak_bf16_tflops="" if peak_tflops is None else peak_tflops,
        mfu="" if peak_tflops is None else achieved / peak_tflops,
    )

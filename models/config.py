"""Model configuration: a frozen dataclass and its named presets."""

from __future__ import annotations

import dataclasses
import math

import jremat

DTYPES = ("float32", "bfloat16")
#: How a block computes attention (:attr:`ModelConfig.attention`).
ATTENTIONS = ("explicit", "xla", "cudnn", "blockwise", "pallas")
#: Attentions whose kernel has no attention dropout: ``attn_dropout`` must be 0 under them.
NO_DROPOUT_ATTENTIONS = ("xla", "cudnn", "pallas")
#: Attentions computed by a fused kernel (no ``[seq, seq]`` tensor kept by any policy).
FUSED_ATTENTIONS = ("cudnn", "blockwise", "pallas")
#: Largest head_dim cuDNN's fused attention takes, by GPU generation (Hopper allows 256).
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MAX_HEAD_DIM_HOPPER = 256


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape, precision and rematerialization of the GPT model.

    Attributes:
      vocab_size: number of token ids.
      max_seq_len: number of learned positions (longest sequence the model accepts).
      n_layers: transformer blocks.
      d_model: residual-stream width.
      n_heads: attention heads.
      head_dim: width of one head (independent of ``d_model``).
      d_ff: MLP hidden width.
      attn_dropout: dropout rate on attention probabilities.
      resid_dropout: dropout rate on each sublayer's output before the residual add.
      dtype: compute dtype name (``float32`` or ``bfloat16``).
      param_dtype: parameter dtype name (``float32`` keeps master weights in f32).
      remat_policy: a policy spec (see ``jremat.describe()``); ``nested:block=M,layer=SPEC``
        checkpoints the layer stack in nested groups (:attr:`jremat.RematConfig.nest`). Or a
        :class:`jremat.Policy`: one the registry built (its ``spec`` set, as
        ``jremat.registry.resolve`` returns it) is kept for the remat config and the field holds
        its spec, so the config prints, saves and compares as text and the spec is not parsed
        again; one without a spec (a hand-made policy) stays an object. The spec is resolved
        once per config (:meth:`remat_config`).
      remat_granularity: ``none``, ``block`` or ``sublayer``.
      scan_layers: run the blocks under ``lax.scan`` (default) rather than unrolled.
      remat_head_chunks: 0 (default) keeps the final LayerNorm, vocabulary head and loss as they
        are (their ``[batch, seq, vocab]`` logits stay live for the backward pass); ``N > 0`` runs
        them over ``N`` sequence chunks, each recomputed in the backward pass, so at most one
        chunk's logits is live. ``N`` must divide the sequence length.
      attention: how attention is computed: ``explicit`` (einsum, softmax, einsum, every tensor
        tagged), ``xla`` (``jax.nn.dot_product_attention(implementation="xla")``), ``cudnn``
        (``implementation="cudnn"``: NVIDIA GPUs, bfloat16, head_dim a multiple of 8, no attention
        dropout), ``blockwise`` (:func:`jremat.attention.blockwise_attention`: no ``[seq, seq]``
        tensor, residuals are the output and its log-sum-exp) or ``pallas`` (JAX's Pallas flash
        attention, ``jax.experimental.pallas.ops.gpu.attention.mha``: compiled on an NVIDIA GPU,
        interpreted elsewhere; no attention dropout). See docs/attention.md.
      attention_block_size: query and key block length of ``blockwise`` attention, and of the
        forward kernel of ``pallas`` attention (a block longer than the sequence is the sequence;
        the sequence must be a multiple of it).
      remat_layer_policies: different policies for contiguous groups of layers, in layer order,
        ``"COUNT:SPEC,...[,rest:SPEC]"``: ``"2:full,rest:none"`` rematerializes layers 0-1 fully
        and keeps everything in the rest; layers no group covers use ``remat_policy``. Empty
        (default): every layer uses ``remat_policy``. See :func:`jremat.internal.parse_layer_policies`.
      moe_experts: 0 (default) for the dense MLP in every block; ``E > 0`` replaces it with a
        mixture-of-experts FFN of ``E`` experts, each a SwiGLU MLP of width ``d_ff`` without biases
        (:class:`models.moe.MoE`, docs/moe.md).
      moe_top_k: experts each token is routed to (a softmax router's top-k, their probabilities
        renormalized to sum to 1); at most ``moe_experts``.
      moe_capacity_factor: under expert parallelism (a mesh with an ``expert`` axis), the slots
        each device sends each expert, as a multiple of its even share ``tokens * top_k / experts``;
        assignments beyond them are dropped (Switch/GShard). On one device dispatch is dropless
        and this is not used.
      moe_load_balance_coef: weight of the load-balancing auxiliary loss (Switch Transformer:
        ``experts * sum_e f_e * P_e`` per layer) in the training gradient.
      moe_router_z_coef: weight of the router z-loss (ST-MoE: the mean squared log-sum-exp of
        the router logits, per layer) in the training gradient.
      moe_shared_expert: add a dense GELU MLP of width ``d_ff`` (the model's ``MLP``, tagged
        with the MLP names) that every token goes through, beside the routed experts.
    """

    vocab_size: int = 10000
    max_seq_len: int = 128
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    head_dim: int = 16
    d_ff: int = 256
    attn_dropout: float = 0.1
    resid_dropout: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat_policy: str = "full"
    remat_granularity: str = "block"
    scan_layers: bool = True
    remat_layer_policies: str = ""
    remat_head_chunks: int = 0
    attention: str = "explicit"
    attention_block_size: int = 128
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25
    moe_load_balance_coef: float = 0.01
    moe_router_z_coef: float = 0.001
    moe_shared_expert: bool = False

    def __post_init__(self):
        # A string is read without JAX (the CLIs read the presets before JAX is imported).
        if (
            not isinstance(self.remat_policy, str)
            and isinstance(self.remat_policy, jremat.Policy)
            and self.remat_policy.spec
        ):
            resolved = self.remat_policy
            object.__setattr__(self, "remat_policy", resolved.spec)
            self._remat_config_of(resolved)
        if (
            not isinstance(self.remat_head_chunks, int)
            or isinstance(self.remat_head_chunks, bool)
            or self.remat_head_chunks < 0
        ):
            raise ValueError(f"remat_head_chunks must be an integer >= 0, got {self.remat_head_chunks!r}")
        for field in ("vocab_size", "max_seq_len", "n_layers", "d_model", "n_heads", "head_dim", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("attn_dropout", "resid_dropout"):
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{field} must be in [0, 1), got {value!r}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field} must be one of {', '.join(DTYPES)}, got {getattr(self, field)!r}")
        self._check_attention()
        self._check_moe()
        # The default remat fields fit every stack; not checking them (which loads the policy
        # registry, and JAX) lets the CLIs read the presets before JAX is imported.
        if (self.remat_policy, self.remat_granularity, self.remat_layer_policies) != ("full", "block", ""):
            self.remat_config().validate_layers(self.n_layers)  # policy, granularity, layer groups

    def _check_attention(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        block = self.attention_block_size
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"attention_block_size must be a positive integer, got {block!r}")
        if self.attention in NO_DROPOUT_ATTENTIONS and self.attn_dropout > 0:
            kernel = "JAX's Pallas flash attention" if self.attention == "pallas" else "jax.nn.dot_product_attention"
            raise ValueError(
                f"attention {self.attention!r} ({kernel}) has no attention dropout, but "
                f"attn_dropout is {self.attn_dropout}; set it to 0 (--dropout 0) or use attention 'blockwise', "
                "which drops out inside the kernel"
            )
        if self.attention == "cudnn":
            if self.dtype != "bfloat16":
                raise ValueError(
                    f"attention 'cudnn' needs dtype bfloat16 (cuDNN's fused kernel takes fp16/bf16), got "
                    f"{self.dtype!r}; pass --dtype bfloat16 or use attention 'blockwise' or 'xla'"
                )
            if self.head_dim % 8 or self.head_dim > CUDNN_MAX_HEAD_DIM_HOPPER:
                raise ValueError(
                    f"attention 'cudnn' needs head_dim a multiple of 8 and at most {CUDNN_MAX_HEAD_DIM} "
                    f"({CUDNN_MAX_HEAD_DIM_HOPPER} on Hopper), got {self.head_dim}; use attention 'blockwise' or 'xla'"
                )

    def _check_moe(self) -> None:
        experts, top_k = self.moe_experts, self.moe_top_k
        if not _is_int(experts) or experts < 0:
            raise ValueError(f"moe_experts must be an integer >= 0 (0: the dense MLP), got {experts!r}")
        if not _is_int(top_k) or top_k < 1:
            raise ValueError(f"moe_top_k must be a positive integer, got {top_k!r}")
        if experts and top_k > experts:
            raise ValueError(
                f"moe_top_k {top_k} is more than the {experts} experts (moe_experts); use at most {experts}"
            )
        factor = self.moe_capacity_factor
        if not _is_number(factor) or factor <= 0:
            raise ValueError(f"moe_capacity_factor must be a positive number, got {factor!r}")
        for field in ("moe_load_balance_coef", "moe_router_z_coef"):
            value = getattr(self, field)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{field} must be a number >= 0, got {value!r}")
        if not isinstance(self.moe_shared_expert, bool):
            raise ValueError(f"moe_shared_expert must be True or False, got {self.moe_shared_expert!r}")

    def parameter_count(self) -> int:
        """Parameters of the GPT this config builds (embeddings, blocks, final LayerNorm, head; biases included)."""
        d, inner, d_ff = self.d_model, self.n_heads * self.head_dim, self.d_ff
        attention = 3 * (d * inner + inner) + inner * d + d
        dense_mlp = d * d_ff + d_ff + d_ff * d + d
        if self.moe_experts:  # router, the experts' three matrices (no biases), the shared expert
            mlp = d * self.moe_experts + self.moe_experts * 3 * d * d_ff + (dense_mlp if self.moe_shared_expert else 0)
        else:
            mlp = dense_mlp
        block = attention + mlp + 4 * d  # two LayerNorms
        return (
            self.vocab_size * d
            + self.max_seq_len * d
            + self.n_layers * block
            + 2 * d
            + d * self.vocab_size
            + self.vocab_size
        )

    def parameter_bytes(self) -> int:
        """Bytes of the parameters in ``param_dtype``."""
        return self.parameter_count() * (2 if self.param_dtype == "bfloat16" else 4)

    def remat_config(self) -> jremat.RematConfig:
        """The :class:`jremat.RematConfig` these fields describe (built, and its policy resolved,
        once per config)."""
        return self.__dict__.get("_remat_config") or self._remat_config_of(self.remat_policy)

    def _remat_config_of(self, policy) -> jremat.RematConfig:
        made = jremat.RematConfig(
            policy=policy,
            granularity=self.remat_granularity,
            scan_layers=self.scan_layers,
            layer_policies=self.remat_layer_policies,
        )
        # A cache of a frozen config: not a field (equality, hashing and asdict see the fields only).
        object.__setattr__(self, "_remat_config", made)
        return made

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_attention_backend(attention: str, head_dim: int, devices=None) -> None:
    """Check that this machine can run ``attention`` (only ``cudnn`` needs a particular one).

    Args:
      attention: :attr:`ModelConfig.attention`.
      head_dim: the model's head width.
      devices: the devices the model runs on (default ``jax.devices()``).

    Raises:
      ValueError: for ``cudnn`` on a backend other than an NVIDIA GPU (a CPU, a TPU, an AMD GPU),
        or with a head_dim above what the GPU's generation takes.
    """
    if attention != "cudnn":
        return
    import jax

    devices = jax.devices() if devices is None else devices
    device = devices[0]
    platform_version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    if device.platform not in ("gpu", "cuda") or "rocm" in platform_version:
        raise ValueError(
            f"attention 'cudnn' needs an NVIDIA GPU with cuDNN, but JAX runs on {device.platform} "
            f"({device.device_kind}); use attention 'blockwise' (same memory behaviour, pure JAX) or 'xla'"
        )
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)
    limit = CUDNN_MAX_HEAD_DIM_HOPPER if major >= 9 else CUDNN_MAX_HEAD_DIM
    if head_dim > limit:
        raise ValueError(
            f"attention 'cudnn' on {device.device_kind} takes head_dim up to {limit}, got {head_dim}; use "
            "attention 'blockwise' or 'xla'"
        )


def whole_step_head_chunks(policy: str, seq_len: int) -> int:
    """The ``remat_head_chunks`` the CLIs use when none is given, so a policy covers the whole step.

    0 for ``none`` (nothing is rematerialized); otherwise the first of 4 and 2 that divides
    ``seq_len`` (0 when neither does): the final LayerNorm, head and loss are recomputed per
    chunk as the blocks are, as the Needle study checkpoints the whole graph.
    """
    if str(policy).split(":")[0] == "none":
        return 0
    return next((n for n in (4, 2) if seq_len % n == 0), 0)


PRESETS: dict[str, ModelConfig] = {
    # For tests: tiny and fast to compile.
    "tiny": ModelConfig(vocab_size=64, max_seq_len=16, n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64),
    # The benchmark's small multi-layer model: runs steps on a 2-core CPU in well under a second.
    "small": ModelConfig(vocab_size=10000, max_seq_len=64, n_layers=4, d_model=128, n_heads=4, head_dim=32, d_ff=512),
    # The configuration of the Needle gradient-checkpointing study on PTB.
    "needle": ModelConfig(vocab_size=10000, max_seq_len=20, n_layers=1, d_model=20, n_heads=8, head_dim=32, d_ff=32),
    "gpt2-small": ModelConfig(
        vocab_size=50257, max_seq_len=1024, n_layers=12, d_model=768, n_heads=12, head_dim=64, d_ff=3072
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset called ``name`` with ``overrides`` applied.

    Raises:
      ValueError: if ``name`` is not a preset (the message lists them) or an override is invalid.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]

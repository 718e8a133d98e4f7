"""The build-profile vocabulary: one home for every option that changes an engine artefact.

Each profile field's default, allowed values and limits live here, and so does the one
function that checks them. Everything else derives from this module: the cache's
``BuildOptions``/``ProfileRequest`` (``cachesvc.cache.profiles``), the launch flags and their
``--help`` (``cachesvc.settings.config``), the admin API's request schema (``cachesvc.http.schemas``,
whose ``Literal`` types a test compares with these tuples) and the builder's
``EngineBuildSpec``. The bundle key hashes every profile field, so two copies of a default
that drift apart would make two entry points build different bundles for the same request.

Errors are :class:`ProfileError` naming the neutral field (``max_input_len``); the CLI turns
field names into flags, the HTTP layer reports them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Builder backends a profile can name (resolved values; never ``auto``).
BACKENDS: tuple[str, ...] = ("onnxruntime", "tensorrt")
#: What a caller may ask for: ``auto`` picks tensorrt only where it imports and a GPU answers.
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)
#: Weight precisions a profile can name.
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4")
#: What a caller may ask for: ``auto`` is fp32 on the CPU, fp16 on TensorRT.
PRECISION_CHOICES: tuple[str, ...] = ("auto", *PRECISIONS)
#: Precisions each backend builds.
BACKEND_PRECISIONS: dict[str, tuple[str, ...]] = {
    # int4 is onnxruntime's MatMulNBits (com.microsoft), a CPU op.
    "onnxruntime": ("fp32", "int8", "int4"),
    "tensorrt": ("fp16", "bf16", "fp32", "int8"),
}
#: ``auto`` precision per backend (onnxruntime: the checkpoint's own, see :func:`native_precision`).
AUTO_PRECISION: dict[str, str] = {"onnxruntime": "fp32", "tensorrt": "fp16"}
#: Precisions whose CPU graph depends on the CPU class (its int8 kernels): the class is part
#: of their profile (``cpu_class``), and a bundle built for another class is stale.
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "int4")
#: ``--kernels`` of a quantized CPU build: ``auto`` (the fastest kernel plan that answers like
#: fp32: the gate's strict test), ``exact`` (float32 compute in every layer), ``fast`` (the fastest
#: plan above the agreement floor); the plans are ``inference.builder.kernel_plan``'s.
KERNEL_MODES: tuple[str, ...] = ("auto", "exact", "fast")
#: ``--kv-cache-dtype`` of an onnxruntime generate build: the element type of its K/V buffers.
#: ``fp16`` halves the KV memory (and the bytes a stored prefix copies) at a small cost per step
#: on CPUs without float16 arithmetic (onnxruntime's CPU GroupQueryAttention converts); the
#: quality gate judges it against fp32 (docs/quantization.md). TensorRT's KV follows its precision.
KV_CACHE_DTYPES: tuple[str, ...] = ("fp32", "fp16")
DEFAULT_KV_CACHE_DTYPE = "fp32"
#: Profile names -> the numpy/``engine.json`` names of the K/V element type.
KV_CACHE_NUMPY_DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16"}
#: GGUF tensor types -> the precision that keeps them (``auto`` on the CPU): 2-4-bit types
#: build int4, 5-8-bit int8, float types fp32.
GGUF_TYPE_PRECISION: dict[str, str] = {
    **dict.fromkeys(("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K"), "int4"),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"), "int8"),
    **dict.fromkeys(("F32", "F16", "BF16"), "fp32"),
}
#: Speculative-decoding methods a profile can name.
SPECULATIVE_METHODS: tuple[str, ...] = (
    "eagle3", "mtp", "dflash", "jetspec", "dspark", "ngram", "draft_model"
)
#: Methods our runtime proposes for itself (:mod:`inference.serving.speculative`): one chain of ``k``
#: guessed tokens (``num_speculative_tokens`` or ``--draft-step``) verified in one target run.
#: ``ngram`` looks the guesses up in the sequence (no second model); ``draft_model`` runs a
#: second bundle built from the draft checkpoint with the same profile.
CHAIN_SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")
#: Methods that run without a draft checkpoint (mtp may still name one).
METHODS_WITHOUT_DRAFT_MODEL: tuple[str, ...] = ("mtp", "ngram")
#: Methods that have no use for a draft checkpoint: naming one is an error.
METHODS_REFUSING_DRAFT_MODEL: tuple[str, ...] = ("ngram",)
#: Methods that need a separate draft checkpoint (``model`` in ``--speculative-config``).
METHODS_NEEDING_DRAFT_MODEL: tuple[str, ...] = tuple(
    m for m in SPECULATIVE_METHODS if m not in METHODS_WITHOUT_DRAFT_MODEL
)
#: Methods whose draft checkpoint is built into a bundle of its own (cached like any bundle).
METHODS_WITH_DRAFT_BUNDLE: tuple[str, ...] = ("draft_model",)
#: Speculative methods each backend builds. The others (eagle3, mtp, dflash, jetspec, dspark)
#: need draft heads or extra graph outputs inside the engine, which no builder emits yet.
BACKEND_SPECULATIVE_METHODS: dict[str, tuple[str, ...]] = {
    "onnxruntime": CHAIN_SPECULATIVE_METHODS,
    # Its plans return last-position logits only: verification would run token by token.
    "tensorrt": (),
}

#: What a bundle is for: ``generate`` (a causal LM: logits, KV cache) or ``embed`` (the final
#: hidden states pooled into one L2-normalised vector per input, ``/v1/embeddings``).
TASKS: tuple[str, ...] = ("generate", "embed")
DEFAULT_TASK = "generate"
#: How an embedding bundle pools over the sequence: ``last`` (the last token's state, as
#: Qwen3-Embedding and other decoder embedders are trained) or ``mean`` (over the real tokens).
POOLING_METHODS: tuple[str, ...] = ("last", "mean")
DEFAULT_POOLING = "last"
#: Backend x precision an embedding bundle is built with: the fp32 graph on onnxruntime (no
#: KV cache, no quality gate; embeddings are compared by cosine, where quantization shows).
EMBED_BACKEND_PRECISIONS: dict[str, tuple[str, ...]] = {"onnxruntime": ("fp32",), "tensorrt": ()}

DEFAULT_MAX_INPUT_LEN = 4096
#: Sequences decoded together. 4, not the replaced server's 1: our users are apps and fleets
#: with concurrent clients, and llama-server also picks 4 slots on its own defaults. KV pages
#: are committed only as positions are written, so idle slots cost address space, not memory.
DEFAULT_MAX_BATCH_SIZE = 4
DEFAULT_MAX_KV_CACHE_CAPACITY = 8192
#: Upper bounds keep absurd values out before they reach a builder (and keep int64 in range).
MAX_TOKENS_LIMIT = 1_048_576
MAX_BATCH_SIZE_LIMIT = 4096

#: The shape limits of a profile: field -> (default, largest allowed value).
SHAPE_LIMITS: dict[str, tuple[int, int]] = {
    "max_input_len": (DEFAULT_MAX_INPUT_LEN, MAX_TOKENS_LIMIT),
    "max_batch_size": (DEFAULT_MAX_BATCH_SIZE, MAX_BATCH_SIZE_LIMIT),
    "max_kv_cache_capacity": (DEFAULT_MAX_KV_CACHE_CAPACITY, MAX_TOKENS_LIMIT),
}


#: Image parts one request may carry (each is decoded and encoded before the request queues): the
#: default bound of a vision-language bundle's ``max_image_tokens`` with its per-image tokens.
MAX_IMAGES_PER_REQUEST = 16
#: The image-token limits of a vision-language profile (``--max-image-tokens``,
#: ``--max-image-tokens-per-image``): None (the default) leaves them to the model (one image: its
#: tokens per image; a request: ``MAX_IMAGES_PER_REQUEST`` images, within ``max_input_len``).
IMAGE_TOKEN_FIELDS: tuple[str, ...] = ("max_image_tokens", "max_image_tokens_per_image")


class ProfileError(ValueError):
    """A profile value breaks a rule. ``field`` is the neutral field name (``max_input_len``)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


def check_choice(field: str, value: object, choices: Sequence[str], *, optional: bool = False) -> None:
    """Raise :class:`ProfileError` unless ``value`` is one of ``choices`` (or None when optional)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or value not in choices:
        extra = " or null" if optional else ""
        raise ProfileError(field, f"must be one of {', '.join(choices)}{extra}, got {value!r}")


def check_shape(field: str, value: object) -> int:
    """Check one shape limit (a positive integer up to its bound); return it."""
    _, upper = SHAPE_LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(field, f"must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ProfileError(field, f"must be a positive integer, got {value}")
    if value > upper:
        raise ProfileError(field, f"must be at most {upper}, got {value}")
    return value


def check_shapes(max_input_len: object, max_batch_size: object, max_kv_cache_capacity: object) -> None:
    """Check the three shape limits and the rule that spans two of them."""
    inputs = check_shape("max_input_len", max_input_len)
    check_shape("max_batch_size", max_batch_size)
    capacity = check_shape("max_kv_cache_capacity", max_kv_cache_capacity)
    if inputs > capacity:
        raise ProfileError(
            "max_input_len",
            f"({inputs}) must not exceed max_kv_cache_capacity ({capacity}); "
            "lower max_input_len or raise max_kv_cache_capacity",
        )


def check_image_limits(max_image_tokens: object, max_image_tokens_per_image: object,
                       max_input_len: int) -> None:
    """The image-token limits of a profile, each None or a positive integer: the images of one
    request share ``max_input_len`` with the text, and one image is part of a request."""
    total, per = (None if value is None else _image_tokens(name, value) for name, value in
                  zip(IMAGE_TOKEN_FIELDS, (max_image_tokens, max_image_tokens_per_image), strict=True))
    for name, value in zip(IMAGE_TOKEN_FIELDS, (total, per), strict=True):
        if value is not None and value > max_input_len:
            raise ProfileError(name, f"({value}) must not exceed max_input_len ({max_input_len}): a "
                               f"prompt's images share it with the text; lower {name} or raise max_input_len")
    if total is not None and per is not None and per > total:
        raise ProfileError("max_image_tokens_per_image",
                           f"({per}) must not exceed max_image_tokens ({total}): one image is part of a "
                           "request; lower it or raise max_image_tokens")


def _image_tokens(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(field, f"must be a positive integer, got {value!r} ({type(value).__name__})")
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ProfileError(field, f"must be a positive integer <= {MAX_TOKENS_LIMIT}, got {value}")
    return value


def check_image_limits_fit(tokens_per_image: int | None, max_image_tokens: int | None,
                           max_image_tokens_per_image: int | None, *, model: str = "the checkpoint") -> None:
    """The image-token limits against the model: ``tokens_per_image`` is what one image of it
    takes (None: a text-only model, which takes no images, so no limit applies to it)."""
    given = [(name, value) for name, value in zip(
        IMAGE_TOKEN_FIELDS, (max_image_tokens, max_image_tokens_per_image), strict=True) if value is not None]
    if not given:
        return
    if tokens_per_image is None:
        raise ProfileError(given[0][0], f"applies only to a vision-language checkpoint; {model} takes text "
                           "only: leave the image-token limits unset")
    for name, value in given:
        if value < tokens_per_image:
            raise ProfileError(name, f"({value}) admits no image: one image of {model} takes "
                               f"{tokens_per_image} tokens; raise it to at least {tokens_per_image} or leave "
                               "it unset")


def image_limits(tokens_per_image: int, max_image_tokens: int | None, max_image_tokens_per_image: int | None,
                 max_input_len: int) -> tuple[int, int]:
    """(max image tokens of a request, of one image) a vision-language bundle enforces: the
    profile's, else one image's tokens and ``MAX_IMAGES_PER_REQUEST`` images within
    ``max_input_len``."""
    per = max_image_tokens_per_image or tokens_per_image
    total = max_image_tokens or min(MAX_IMAGES_PER_REQUEST * per, max_input_len)
    return total, per


def check_backend_precision(backend: str, precision: str) -> None:
    """Raise when ``backend`` does not build ``precision`` (both resolved, not ``auto``)."""
    check_choice("backend", backend, BACKENDS)
    check_choice("precision", precision, PRECISIONS)
    allowed = BACKEND_PRECISIONS[backend]
    if precision not in allowed:
        others = [b for b, precisions in BACKEND_PRECISIONS.items() if precision in precisions]
        where = f"is for the {' or '.join(others)} backend" if others else "is built by no backend"
        raise ProfileError(
            "precision",
            f"precision {precision!r} {where}; the {backend} backend builds {', '.join(allowed)}",
        )


def check_backend_speculative(backend: str, method: str | None) -> None:
    """Raise when ``backend`` cannot serve speculative ``method`` (None: no speculation)."""
    if method is None:
        return
    check_choice("speculative_method", method, SPECULATIVE_METHODS)
    allowed = BACKEND_SPECULATIVE_METHODS.get(backend, ())
    if method in allowed:
        return
    if method in CHAIN_SPECULATIVE_METHODS:
        why = (f"the {backend} engine returns last-position logits only, so verifying a chain of "
               "guesses would run one step per token")
    else:
        why = (f"{method} needs draft heads or extra outputs built into the engine, which the "
               f"{backend} builder does not emit")
    runs = f"it runs {', '.join(allowed)}" if allowed else "it runs no speculative method yet"
    raise ProfileError("speculative_method", f"speculative method {method!r} is not supported by the "
                       f"{backend} backend: {why}; {runs}")


def check_task(task: str, pooling: str | None, backend: str, precision: str) -> None:
    """Raise unless ``task`` (with ``pooling`` for embeddings) fits ``backend`` x ``precision``."""
    check_choice("task", task, TASKS)
    if task != "embed":
        if pooling is not None:
            raise ProfileError("pooling", f"applies only to task 'embed', got task {task!r}")
        return
    check_choice("pooling", pooling, POOLING_METHODS)
    allowed = EMBED_BACKEND_PRECISIONS.get(backend, ())
    if precision not in allowed:
        builds = (f"the {backend} backend builds embeddings at {', '.join(allowed)}" if allowed
                  else f"the {backend} backend builds no embedding bundles; use onnxruntime")
        raise ProfileError("task", f"task 'embed' at precision {precision!r}: {builds}")


def check_kv_cache_dtype(value: object, backend: str, task: str) -> None:
    """``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`; other than the default only for a
    generate bundle of the onnxruntime backend."""
    check_choice("kv_cache_dtype", value, KV_CACHE_DTYPES)
    if value != DEFAULT_KV_CACHE_DTYPE and (backend not in ("auto", "onnxruntime") or task != "generate"):
        raise ProfileError("kv_cache_dtype", f"{value} applies only to generate bundles of the onnxruntime "
                           f"backend (TensorRT's KV follows its precision), not {backend} {task}")


def check_draft_model(method: str | None, has_draft: bool) -> None:
    """Raise unless speculative ``method`` and the presence of a draft checkpoint fit."""
    if method in METHODS_NEEDING_DRAFT_MODEL and not has_draft:
        raise ProfileError("draft_model", f"method {method!r} needs a draft model")
    if method in METHODS_REFUSING_DRAFT_MODEL and has_draft:
        raise ProfileError("draft_model", f"method {method!r} uses no draft model; drop it")

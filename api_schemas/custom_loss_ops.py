"""What a server-side custom loss may do: the allowlist its graph is checked against, as plain names (no torch).

A graph node names a function by the qualified name torch.fx gives it (what the SDK's `encode_graph` sends, e.g.
`torch.exp`, `operator.mul`, `torch._C._nn.log_sigmoid`) or a tensor method by its name. Everything here is pure
tensor math whose cost grows with the size of its operands and result: elementwise functions, reductions,
shape functions, a few losses of torch.nn.functional, and factories whose size the worker checks before
allocating. Left out on purpose: anything that reads or writes files, processes or modules, in-place operations,
uninitialised memory (`empty*`), random numbers, device moves, and matrix products and norms (their cost grows
faster than their result: a matrix norm runs an SVD). The worker resolves each name to its callable
(`workers/engine/custom_loss.py`) and a unit test checks that every name resolves and round-trips through
torch.fx's naming.
"""

from __future__ import annotations

_ELEMENTWISE = (
    "abs neg negative exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square sigmoid logit tanh sin cos sign sgn "
    "reciprocal floor ceil round trunc frac erf erfc lgamma digamma relu isfinite isnan isinf nan_to_num "
    "logical_not positive add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow "
    "float_power maximum minimum fmax fmin atan2 logaddexp logaddexp2 eq ne lt le gt ge greater greater_equal less "
    "less_equal not_equal logical_and logical_or logical_xor where clamp clip clamp_min clamp_max lerp xlogy hypot "
    "copysign masked_fill"
).split()
_REDUCTIONS = (
    "sum nansum mean nanmean prod max min amax amin argmax argmin std var logsumexp cumsum cumprod logcumsumexp "
    "cummax cummin all any count_nonzero median sort topk softmax log_softmax"
).split()
_SHAPES = (
    "reshape flatten unflatten squeeze unsqueeze transpose swapaxes permute movedim t gather take_along_dim "
    "index_select narrow select roll flip diff broadcast_to tile repeat_interleave chunk unbind tril triu diagonal "
    "outer clone detach masked_select"
).split()
# torch.X functions that are not also tensor methods.
_TORCH_ONLY = (
    "std_mean var_mean stack cat concat concatenate hstack vstack zeros_like ones_like full_like zeros ones full "
    "arange linspace"
).split()

ELEMENTWISE: tuple[str, ...] = tuple(_ELEMENTWISE)  # the worker sizes these by broadcasting their operands
REDUCTIONS: tuple[str, ...] = tuple(_REDUCTIONS)  # ... and these as no bigger than their one operand

# call_function targets.
FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in (*_ELEMENTWISE, *_REDUCTIONS, *_SHAPES, *_TORCH_ONLY)]
    + ["torch.functional.split"]
    + [
        f"torch.nn.functional.{n}"
        for n in (
            "log_softmax softmax relu silu cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss kl_div "
            "binary_cross_entropy_with_logits normalize pad"
        ).split()
    ]
    + [f"torch._C._nn.{n}" for n in ("log_sigmoid", "softplus", "gelu", "one_hot")]
    + [
        f"torch._C._special.special_{n}"
        for n in ("exp2", "expit", "logit", "log1p", "expm1", "xlogy", "log_softmax", "softmax", "erf")
    ]
    # Python operators as torch.fx records them (the SDK names them by the public operator module).
    + [
        f"operator.{n}"
        for n in "add sub mul truediv floordiv mod pow neg pos abs invert getitem eq ne lt le gt ge and_ or_ xor".split()
    ]
    + [f"math.{n}" for n in ("exp", "log", "log1p", "expm1", "sqrt", "tanh", "floor", "ceil", "fabs")]
    + ["getattr"]
)

# Tensor attributes `getattr` may read (torch.fx records `x.shape` as getattr(x, "shape")).
TENSOR_ATTRIBUTES: frozenset[str] = frozenset({"shape", "dtype", "device", "ndim", "T", "mT"})
# Fields of the named tuples reductions return (torch.max(x, dim).values, torch.topk(...).indices).
RESULT_FIELDS: frozenset[str] = frozenset({"values", "indices"})
ATTRIBUTES: frozenset[str] = TENSOR_ATTRIBUTES | RESULT_FIELDS

# call_method targets: tensor methods.
METHODS: frozenset[str] = frozenset(
    [*_ELEMENTWISE, *_REDUCTIONS, *_SHAPES, "split"]
    + (
        "view view_as reshape_as expand expand_as repeat contiguous type_as float double half bfloat16 long int "
        "bool to size dim numel new_zeros new_ones new_full"
    ).split()
)

# Functions and methods whose result size comes from their arguments (not only from their operands): the worker
# computes their result on the meta device (sizes only, no memory) and checks it before running them for real.
# The worker in fact size-checks EVERY operation this way; these are the ones that also take a `device`.
FACTORIES: frozenset[str] = frozenset(
    {"torch.zeros", "torch.ones", "torch.full", "torch.arange", "torch.linspace", "torch.zeros_like",
     "torch.ones_like", "torch.full_like", "new_zeros", "new_ones", "new_full"}
)

# Size limits the worker enforces on every intermediate tensor (before allocating it, via the meta device); the
# gateway already rejects a factory whose constant size is over the first.
MAX_ELEMENTS = 1 << 24  # one intermediate tensor (64 MiB of float32)
# Every intermediate of one job, all datums together, plus the gradients its backward writes (an op's operands that
# need one: x[0] is a view, but its backward writes a gradient the size of x): TOTAL_ELEMENTS_PER_TOKEN per logprob of the job, within
# [MIN_TOTAL_ELEMENTS, MAX_TOTAL_ELEMENTS]. A loss's work then grows with its job's forward pass (which costs far
# more per token), so a small request cannot buy a long step that every merged tenant waits for.
TOTAL_ELEMENTS_PER_TOKEN = 256
MIN_TOTAL_ELEMENTS = 1 << 24
MAX_TOTAL_ELEMENTS = 1 << 28
# Node executions per job (nodes x datums): each costs 15-80 us of the worker's Python whatever the tensor sizes,
# and one job's step is every merged tenant's wait. 2**17: a 128-node loss on a full SDK chunk of 1024 datums.
# The gateway refuses a request over it before queueing.
MAX_NODE_RUNS = 1 << 17

# torch.diff(x, n) differences n times (n passes over x, on meta too, while only the last result is charged).
MAX_DIFF_ORDER = 4

# Keyword arguments no node may pass: `out` and `inplace` write into an existing tensor (an input, or a value saved
# for the backward), `requires_grad` makes new leaves, `pin_memory` and `generator` reach outside pure math, and
# repeat_interleave's `output_size` is trusted by the CUDA kernel (a wrong one is a device-side assert, which
# leaves the worker's CUDA context unusable for every tenant), and gather's `sparse_grad` makes the logprobs'
# gradient sparse, which the merged backward through the base model does not take.
FORBIDDEN_KWARGS: frozenset[str] = frozenset(
    {"out", "inplace", "requires_grad", "pin_memory", "generator", "memory_format", "output_size", "sparse_grad"})
# The same parameters where a function also takes them positionally: F.relu(x, True) is in-place, and the fifth
# parameter of F.normalize is `out`. target -> the position of that parameter in the node's args.
FORBIDDEN_POSITIONAL: dict[str, int] = {
    "torch.nn.functional.relu": 1, "torch.nn.functional.silu": 1, "torch.nn.functional.normalize": 4}

# Encoded constants ({"dtype": ...} etc.) a graph may carry.
DTYPES: frozenset[str] = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
LAYOUTS: frozenset[str] = frozenset({"strided"})

# Operators whose operands may be Python numbers; the worker bounds the numbers they produce.
NUMERIC_OPERATORS: frozenset[str] = frozenset(
    f"operator.{n}" for n in "add sub mul truediv floordiv mod pow neg pos abs invert eq ne lt le gt ge and_ or_ xor".split()
)

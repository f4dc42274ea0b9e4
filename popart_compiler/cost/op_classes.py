"""Op classes of the IPU Model's cycle estimate: how Poplar runs each kind of op.

Every op but a view runs as a few *compute sets*, each a BSP superstep (an exchange
phase, the vertices' compute, a synchronisation of the tiles), and pays
:data:`COMPUTE_SET_CYCLES` for each besides the work its bytes and elements need
(:mod:`.cycle_model`). How many compute sets an op takes follows from how poplibs
builds it:

* **pointwise** ops (``relu``, ``add``, ``gelu``, casts, dropout): one, in place
  where PopART can (:mod:`.op_costs`);
* **reductions** (sums, means, ``max``, losses): a partial reduction on each tile,
  the partials exchanged, a final reduction (two);
* **normalisations** (layer, group, batch norm): the statistics (two reductions),
  the normalisation (four);
* **softmax** and ``log_softmax``: a max, the exponentials, a sum, the division
  (four);
* **gathers and embeddings**: the indices broadcast, the rows exchanged (two);
  their backward adds the rows into the table (``multiUpdateAdd``);
* **matmuls and convolutions**: each product re-arranges its operands, runs the
  AMP passes and reduces the partial sums (three per product; their cycles are the
  plan's, :mod:`.matmul_plan`); grouped and depthwise convolutions plan their groups
  (``MatmulProblem.groups``), 1-D and strided ones their output positions.

Backward runs two compute sets for every forward one (the gradients of the inputs and
of the weights), recomputation the forward ones again. The weight update of each
trainable tensor runs :data:`UPDATE_COMPUTE_SETS` of its optimizer (PopART updates
each weight on its own, ``mergeVarUpdate`` being off by default).
"""
from __future__ import annotations

__all__ = ["op_class", "compute_sets", "COMPUTE_SET_CYCLES", "UPDATE_COMPUTE_SETS",
           "POINTWISE", "REDUCTION", "NORMALISATION", "SOFTMAX", "GATHER", "PRODUCT",
           "VIEW"]

POINTWISE, REDUCTION, NORMALISATION, SOFTMAX, GATHER, PRODUCT, VIEW = (
    "pointwise", "reduction", "normalisation", "softmax", "gather", "product", "view")

#: Cycles of one compute set besides its work: the exchange phase's and the
#: vertices' start-up and the tiles' synchronisation. The one constant fitted to the
#: small-program case of the validation set (``bench/validation.py``,
#: ``docs/ipu-model-estimates.md``); the matmul plans count their own syncs.
COMPUTE_SET_CYCLES = 1500.0

_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod",
    "argmax", "argmin", "logsumexp", "norm", "linalg_vector_norm", "cross_entropy_loss",
    "nll_loss", "nll_loss_nd", "nll_loss_forward", "mse_loss", "l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
    "smooth_l1_loss", "ctc_loss", "cumsum", "topk", "sort"})
_NORMS = frozenset({
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
    "native_batch_norm", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "instance_norm", "rms_norm"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
_GATHERS = frozenset({
    "embedding", "gather", "index_select", "index", "take", "embedding_bag",
    "_embedding_bag", "scatter", "scatter_add", "index_put", "index_add", "one_hot",
    "take_along_dim"})

#: Compute sets of each class's forward (products: per product).
_FORWARD_SETS = {POINTWISE: 1, REDUCTION: 2, NORMALISATION: 4, SOFTMAX: 4, GATHER: 2,
                 PRODUCT: 3, VIEW: 0}

#: Compute sets of one trainable tensor's update, by optimizer (PopART's var update
#: ops: SGD's velocity and weight; Adam's moments, bias correction and update; LAMB
#: adds the two norms and the trust ratio).
UPDATE_COMPUTE_SETS = {"SGD": 2, "Adam": 5, "AdamW": 5, "RMSprop": 4, "LAMB": 8}


def op_class(op) -> str:
    """The class of an ``OpCost`` (module docstring)."""
    if op.view:
        return VIEW
    if op.products:
        return PRODUCT
    name = op.op
    if name in _SOFTMAX:
        return SOFTMAX
    if name in _NORMS:
        return NORMALISATION
    if name in _GATHERS:
        return GATHER
    if name in _REDUCTIONS:
        return REDUCTION
    return POINTWISE


def compute_sets(op) -> int:
    """Compute sets of the op's forward (its backward runs twice as many)."""
    kind = op_class(op)
    if kind == PRODUCT:
        return _FORWARD_SETS[PRODUCT] * sum(p.repeat for p in op.products)
    return _FORWARD_SETS[kind]

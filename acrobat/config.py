"""Every runtime flag of acrobat, with its default, in one place.

Values are read from the environment once, at import; change them at run time by
assigning the attributes (``acrobat.config.DEBUG = 2``) or with :func:`override`.
"""

from __future__ import annotations

import contextlib
import os


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


#: 0 silent; 1 print a schedule summary per flush; 2 also every batch; 3 also verify the
#: graph (``graph.lint``) before each flush.
DEBUG: int = _env_int("ACROBAT_DEBUG", 0)

#: Verify graph invariants (topological order, one signature per batch, each node run once)
#: at every flush. Tests turn it on; it costs a pass over the graph. Also: outputs released
#: while a map without autograd runs (FREE_OUTPUTS) are kept to its end, filled with NaN
#: (executor.poison_freed), so a read the handle counts missed shows in the results.
VERIFY: bool = bool(_env_int("ACROBAT_VERIFY", 0))

#: Automatic coarsening: straight-line functions reachable from an autobatched function
#: run as blocks inside f.map (see analysis.py). Off: only @acrobat.block functions do.
AUTO_BLOCKS: bool = bool(_env_int("ACROBAT_AUTO_BLOCKS", 1))

#: With AUTO_BLOCKS, also the methods of the user's own ``nn.Module`` classes among a map's
#: shared arguments (and their submodules): ``forward`` (the module is called) and every
#: method whose name the reachable code uses (``model.combine(l, r)``), straight-line ones
#: as blocks, the others searched and outlined like functions with control flow.
AUTO_METHODS: bool = bool(_env_int("ACROBAT_AUTO_METHODS", 1))

#: An ``nn.Sequential`` of pure layers (Linear, activations, LayerNorm, eval-mode Dropout)
#: called on a lazy tensor is one block node per call (ops._sequential_forward; with
#: FAST_MODULES). Read at every call.
SEQUENTIAL_BLOCKS: bool = bool(_env_int("ACROBAT_SEQUENTIAL_BLOCKS", 1))

#: nn.LSTM / nn.GRU / nn.RNN on one lazy sequence per call (no initial state): the
#: sequences of every instance, of any lengths, run as one packed call of the module
#: (ops._sequence_forward; with FAST_MODULES). Read at every call.
PACKED_SEQUENCES: bool = bool(_env_int("ACROBAT_PACKED_SEQUENCES", 1))

#: With AUTO_BLOCKS, also the straight-line runs inside functions with control flow (an
#: LSTM cell written inline after a tree encoder's recursive calls): each maximal run of
#: assignments making at least 2 tensor calls becomes one block node (analysis.outline).
AUTO_REGIONS: bool = bool(_env_int("ACROBAT_AUTO_REGIONS", 1))

#: With AUTO_REGIONS, a counted loop ``for _ in range(k):`` whose body is such a run (and
#: does not read the counter) records as ONE node per instance, however many steps it
#: takes; a batch of them runs as one loop over the rows still looping (acrobat/scan.py).
#: Off: the loop runs as written, its body one block per step. Read at every call.
AUTO_SCANS: bool = bool(_env_int("ACROBAT_AUTO_SCANS", 1))

#: File in which online variant choices (choice.py) are saved and reloaded; "" keeps
#: them in memory only.
CHOICE_CACHE: str = os.environ.get("ACROBAT_CHOICE_CACHE", "")

#: Fused elementwise kernels for block tails (fusion.py). "auto" (the default): on the
#: CPU a block's elementwise region (an LSTM cell's gates and state update) runs as one
#: numba kernel inside the block's generated code (Trace.run_fused), once the kernel is
#: compiled (1-2 s in the background, per-op torch meanwhile; then numba's disk cache);
#: on a GPU op by op: the CUDA kernel, launched through the driver and reading its
#: operands in place, measured level with torch's ops (H200, plain code, small, 9
#: alternating rounds, python -m bench.ab --flag KERNEL_BACKEND --values off,auto: TreeLSTM
#: b64 1.09x, b8 0.92x, the other models 0.97-1.01x).
#: Measured on this 2-core CPU, in-process A/B against "off" (plain code): TreeLSTM
#: 1.07-1.13x at b8, 1.04-1.11x at b64, the other models level (few or no regions); an
#: LSTM written inline in a loop (its steps run the region fused, Trace.step_runner)
#: 1.17x at b8, 1.06x at b64.
#: "online" chooses between the kernel (numba on CPU, CUDA on GPU) and per-op torch per
#: block and batch-size bucket (choice.py): the choice follows the block's whole time,
#: GEMM included, whose noise on this VM outweighs the tail (it picked torch in 5 of 9
#: buckets of TreeLSTM large b64, where the kernel is 6% faster). "numba", "cuda" or
#: "torch" (the kernels' reference backend) force the fused path; "off" never fuses.
#: The bench system "acrobat-fused" measures "online".
KERNEL_BACKEND: str = os.environ.get("ACROBAT_KERNEL_BACKEND", "auto")

#: While a map runs, ``nn.Linear`` and ``nn.Embedding`` (not subclasses that define their
#: own forward) record lazy inputs directly instead of through ``F.linear`` /
#: ``F.embedding`` and torch's Python ``__torch_function__`` dispatch: 8.2 -> ~3 us per
#: word lookup. Off: every call takes the generic route (the results are the same).
FAST_MODULES: bool = bool(_env_int("ACROBAT_FAST_MODULES", 1))

#: While a map runs, the torch functions of the op table (``torch.tanh``, ``torch.cat``,
#: ``F.linear``... in ``torch``, ``torch.nn.functional``, ``torch.special``,
#: ``torch.linalg``) are stand-ins that record lazy arguments directly, as LazyTensor's
#: methods do, instead of through torch's dispatch to the TorchFunctionMode: 1.9 -> ~0.6
#: us per recorded ``torch.tanh(h)`` (``python -m bench.record``). Real arguments go to
#: torch as they are. Off: every call takes the mode (the results are the same).
FAST_FUNCTIONS: bool = bool(_env_int("ACROBAT_FAST_FUNCTIONS", 1))

#: Recorded nodes that nothing can read any more (no LazyTensor of theirs is alive: an
#: unused ``x.detach()``, an output the code dropped) are not executed
#: (scheduler.prune_dead; counted in ``stats.dead``).
PRUNE_DEAD: bool = bool(_env_int("ACROBAT_PRUNE_DEAD", 1))

#: A flush forced by value demands leaves the buckets of graph sinks no fiber waits for
#: (nodes nothing recorded reads) pending; they run in a later flush with the nodes of
#: their bucket recorded meanwhile, the map's last one levelled late so they meet there
#: (scheduler.unneeded): DRNN's per-instance stack of logits, 11 batches -> 1 a map.
DEFER_UNNEEDED: bool = bool(_env_int("ACROBAT_DEFER_UNNEEDED", 1))

#: A flush forced by value demands is also levelled as late as possible (by each node's
#: longest path to the end of the flush) and runs that way when it needs fewer batches:
#: the demanded values of all instances then line up, where levelling by depth splits
#: them whenever one branch of an ``if`` is shorter (StackRNN: a SHIFT vs. a reduce
#: step; ACRoBat inserts "ghost operators" into the shorter branch for this). Costs one
#: pass over the flush's nodes; the flush at the end of a map keeps depth levelling
#: unless a demand flush left sinks pending for it (DEFER_UNNEEDED).
RELEVEL: bool = bool(_env_int("ACROBAT_RELEVEL", 1))

#: A batch of a block whose trace folded in a shared constant (``cell(x, torch.zeros(h))``)
#: joins a batch of the same block given a per-instance tensor there at the same level,
#: the constant read as a row (scheduler.family): a parser's reduce steps on an
#: empty buffer run with the other instances' steps instead of as a batch of their own.
MERGE_LIFTED: bool = bool(_env_int("ACROBAT_MERGE_LIFTED", 1))

#: Traces of one block that are one program up to the size of one per-instance dim (a
#: sentence's tokens, the vectors an instance attends over) run as one batch padded to
#: the largest size, pads masked where an op reads them (acrobat/padding.py), instead of a
#: batch per size. ``PAD_WASTE``: a padded batch is cut where its padded work (rows x
#: size ** ragged dims) would exceed this many times the true work.
PAD_RAGGED: bool = bool(_env_int("ACROBAT_PAD_RAGGED", 1))

#: With PAD_RAGGED, a block's traces whose arguments vary in two or more sizes apart (a
#: graph's node and edge counts, a sentence pair's two lengths) form one family too, each
#: size padded on its own (padding.Ragged's ``sym``): a batch is cut into runs whose
#: largest member is at least as large as every other in every size (its program serves
#: them all) and whose padded work stays within PAD_WASTE (a member's work: the sum over
#: its kinds of values, ``n + E`` for a graph's node states and edge messages, not the
#: ``n * E`` of a value ragged in both; edge_gnn pattern b64 10.4 -> 7.5 ms, 6 runs a
#: step -> 2). 0: such a block records op by op, each op batched per shape
#: (padding.SizesApart).
PAD_APART: bool = bool(_env_int("ACROBAT_PAD_APART", 1))

#: A torch function or Tensor method with no row in the op table (``torch.fmod``,
#: ``F.softmin``, ``x.acos()``) batches by torch.vmap where it is a pure op of torch's
#: (acrobat.ops.generic_op: native or from torch's functional namespaces, not in place,
#: not random, its result's shape not set by values). 0: such calls raise
#: UnsupportedOpError.
GENERIC_VMAP: bool = bool(_env_int("ACROBAT_GENERIC_VMAP", 1))
PAD_WASTE: float = float(os.environ.get("ACROBAT_PAD_WASTE", "3"))

#: Tensors in the attributes of the user's objects among a map's arguments (a tree of
#: ``Node``\ s with ``node.x``) read as per-instance inputs in instance code, as tensors in
#: lists do (acrobat/objects.py). Off: they are real tensors and their ops run eagerly.
OBJECT_INPUTS: bool = bool(_env_int("ACROBAT_OBJECT_INPUTS", 1))

#: Batched ``tanh`` runs a vectorised numba kernel (acrobat_kernels/unary.py) for float32
#: CPU tensors of at least 1024 elements: 3-4x faster than ``torch.tanh``, which this
#: CPU build of torch evaluates one element at a time; within 2 ulp of float64 (torch:
#: 1 ulp). Off: batches call ``torch.tanh``.
FAST_TANH: bool = bool(_env_int("ACROBAT_FAST_TANH", 1))

#: Batched float32 linear layers may run a numba loop that reads W once for eight rows at
#: a time (acrobat_kernels/gemm.py), split by rows over torch's OpenMP threads when large,
#: instead of torch's GEMM, which is slow for few rows on this CPU (alone: 4 x 512 -> 256
#: in 8.8 µs against 31.5 for torch on 2 threads) and, in this CPU wheel's MKL on this AMD
#: CPU, for many (64 x 512 -> 1280: 254 against 432 µs). Which of the two runs is chosen
#: online per shape and rows bucket (ops.batched_linear). In the models, alternating in
#: one process: up to 16 rows, NestedRNN large b8 -18%, StackRNN large b8 -16%, TreeLSTM
#: large b8 -14%; any rows: TreeLSTM small b64 20.8 -> 17.1 ms, large b64 54.7 -> 44.9,
#: StackRNN small b64 58.8 -> 53.5, DRNN small b64 16.0 -> 14.8. Under autograd too, with a
#: backward by the same loop on transposed copies (each of grad_x and grad_W chosen online
#: against torch's; W's transpose kept while W is unchanged): a training step of Berxit
#: small b8 67.6 -> 51.6 ms, TreeLSTM small b64 58.6 -> 50.1. float32 CPU only. Off:
#: torch's GEMM for every batch.
FAST_GEMM: bool = bool(_env_int("ACROBAT_FAST_GEMM", 1))

#: A batched loop whose body is an Elman step, ``tanh(W h + b + c)`` with ``c`` hoisted
#: out of the loop, runs its steps (on <= 256 rows) in one numba call
#: (acrobat_kernels/recurrence.py), rows split over torch's threads, instead of a GEMM
#: and a tanh call per step. In-process A/B: NestedRNN small b8 32.7 -> 15.2 ms on one
#: thread (14.8 on two), small b64 93.1 -> 86.3 on one, 81.0 -> 58.5 split; BiRNN small
#: b8 2.16 -> 1.39 (1.28), small b64 8.83 -> 7.38 (7.02).
#: Not under autograd, float32 CPU only. Off: one step at a time.
FAST_RECURRENCE: bool = bool(_env_int("ACROBAT_FAST_RECURRENCE", 1))

#: Gathers of scattered rows (executor.gather) copy each row from its address in one numba
#: call (acrobat_kernels/gather.py) on CPU without autograd, instead of torch's
#: index_select per source + cat + reorder: 64 rows from several batches 65 -> 9 us alone,
#: ~52 -> ~25 us as measured inside the models.
#: Off (or with autograd recording, or off the CPU): torch ops.
FAST_GATHER: bool = bool(_env_int("ACROBAT_FAST_GATHER", 1))

#: A batch's outputs are released while the map runs, each as soon as no lazy tensor of
#: it is left (the user's variables, the operands of nodes not run yet): a computed node
#: lets go of its operands (inputs, args), and the batch counts the handles of each of
#: its outputs (_native.finish_rows' OutBlock). The next batches' buffers then come from
#: memory just freed, still in the caches, instead of a map-long heap of outputs (DRNN
#: small b64: a node cell's state, 1.6 of the 3.3 MB a map kept to its end). Only where
#: autograd does not record (a gradient's requires_grad walk reads computed nodes'
#: operands). Off: every output lives until the map ends.
FREE_OUTPUTS: bool = bool(_env_int("ACROBAT_FREE_OUTPUTS", 1))

#: On a GPU, gather indices go up through one page-locked ring buffer into one device
#: ring buffer (tensor.IndexRing) instead of a page-locked and a device tensor each.
INDEX_RING: bool = bool(_env_int("ACROBAT_INDEX_RING", 1))

#: On a GPU (with cupy), rows spread over several producer batches are gathered by one
#: kernel reading each row from its address (acrobat_kernels/cuda_gather.py) instead of
#: torch's views, ``cat`` and ``index_select``.
CUDA_GATHER: bool = bool(_env_int("ACROBAT_CUDA_GATHER", 1))

#: Alignment while recording: a node whose (phase, depth, signature) bucket does not
#: exist yet joins the nearest bucket of its signature up to this many levels deeper, if
#: any (its consumers then follow it there). Depth levelling puts a rare step (NestedRNN's
#: outer GRU step between inner loops of different lengths) at a different level in every
#: instance, one small batch each; waiting a few levels lets them share one. Costs
#: nothing where buckets exist (most nodes). NestedRNN small b64: 2198 -> 1654 batches,
#: -13% time; a wider window lengthens the critical path more than it merges (16: no
#: better). 0: pure depth levelling.
ALIGN_WINDOW: int = _env_int("ACROBAT_ALIGN_WINDOW", 8)

#: Record nodes with the C helpers of ``acrobat/_native.c`` (built at install when a C
#: compiler is present): graph.Node and LazyTensor keep their fields in C, and
#: ``add_node`` and block calls that hit their trace cache run in C. 0 (or the module not
#: built): the same steps in Python. Read once, at import (it picks the classes' bases).
NATIVE: bool = bool(_env_int("ACROBAT_NATIVE", 1))

#: At the first map, tell glibc's malloc to keep freed memory (up to 32 MiB a request)
#: for reuse instead of returning it to the system, so a mini-batch's large temporaries
#: are the previous one's memory rather than fresh pages that fault on first write
#: (acrobat/memory.py). Process-wide; the process keeps its peak heap. BiRNN large b64
#: 71 -> 44 ms, MV-RNN large 161 -> 136 (in-process alternation, 2 threads). 0: malloc
#: is left alone. Read at every map.
HOLD_MEMORY: bool = bool(_env_int("ACROBAT_HOLD_MEMORY", 1))

#: Parked worker greenlets kept per thread for the next fibers (acrobat/fibers.py): a
#: fiber that finds one parked starts with a switch (~0.3 µs) instead of a new greenlet
#: (~9 µs). A map whose instances hold more fibers at once than this makes the rest anew
#: every map: 64 instances forking a binary tree of depth 5 each (4032 fibers) 6.4 -> 3.6
#: µs a fork with 8192 against 1024. A parked worker holds ~5 KB (its saved stack): up
#: to ~40 MB kept after a map that needed them all. Read as fibers end.
FIBER_POOL: int = _env_int("ACROBAT_FIBER_POOL", 8192)

#: Per function, batch-size bucket (powers of two), grad mode and module arguments, the
#: first maps time the batched map against the eager loop on the real work (each trial
#: computes the map's results), then keep the faster (the eager loop only where it beat
#: the batched map by 10%; api._MapChoice; the batched map kept early when 3x faster), and
#: re-check the verdict now and then (the other variant run once after 64 maps times its
#: slowdown, the period doubling while the verdict stands: at most ~1/64 of the time goes
#: to re-checks, and a verdict made while traces warmed up is revised). A map asked for
#: ``stats=True`` always runs batched. Small batches of per-instance work that is a few
#: large ops (a text CNN over 8 sentences: 1.9 ms batched, 0.8 eager) then run as the
#: eager loop. Read at every map.
MAP_CHOICE: bool = bool(_env_int("ACROBAT_MAP_CHOICE", 1))

#: ``torch.stack(parts)`` / ``torch.cat(parts)`` along dim 0 of lazy parts of one shape
#: record with a signature that leaves out the number of parts (ops._special_flat): the
#: per-sentence stacks of a batch of sentences of 27 different lengths are one batch, one
#: gathered column of all their parts, each instance's result a view of its rows. Off:
#: one batch per part count. Read at every call.
RAGGED: bool = bool(_env_int("ACROBAT_RAGGED", 1))

#: Op-by-op work over per-instance values whose leading size differs from instance to
#: instance (a pointer network's scores over its own tokens) batches across the sizes:
#: ``x[i]`` (a row of each instance's x: one concatenation of all of them, one index) and
#: whole reductions ``x.max()`` / ``x.sum()`` / ``x.argmax()`` ... (the values padded with
#: the reduction's neutral element, reduced along one dim): their signatures leave the
#: leading size (the pick) or the whole shape (the reduction) out. Off: a batch per
#: shape. Read at every call.
RAGGED_ROWS: bool = bool(_env_int("ACROBAT_RAGGED_ROWS", 1))

#: ``x[i]`` of a lazy tensor with a Python int ``i`` that differs from instance to instance
#: (the score of the chosen token, ``logp[tok]``; a label's log-probability) batches
#: across the ints: the int is left out of the op's signature and a batch picks each
#: node's row (``X[arange(n), idx]``; one int for all: the view ``X[:, i]``). Off, each
#: int value is a signature of its own (a batch per value). Read at every call.
INT_PICKS: bool = bool(_env_int("ACROBAT_INT_PICKS", 1))

#: A batch of a block whose program draws no random numbers runs once per distinct row of
#: operands where some of its nodes read exactly the same rows (executor._distinct): the
#: leaf cells of a batch of trees over the same word (64 SST test trees: 1,144 leaves,
#: 594 distinct words), whose embedding rows are the table's own. The other nodes get
#: the row of the first node with their operands; what eager computes twice it computes
#: once, bit for bit the same. Only where an operand comes from rows that nodes already
#: share (table rows in place, an earlier batch run this way). Read at every batch.
DISTINCT_ROWS: bool = bool(_env_int("ACROBAT_DISTINCT_ROWS", 1))

#: A loop outlined as a scan whose state starts as a constant made by a pure factory
#: (``h = torch.zeros(n)`` before ``for x in xs: h = cell(x, h)``) reads that constant as
#: a row shared by every instance (executor.constant), so its first step runs with the
#: others; off, the first step is peeled off and recorded as one block call per instance.
#: Read at every call.
CONSTANT_STATES: bool = bool(_env_int("ACROBAT_CONSTANT_STATES", 1))

#: With AUTO_BLOCKS, a straight-line function's parameter read only as ``torch.tensor(p)``
#: (``word(model, word_id)``) is given that tensor at the call when the argument is a Python
#: number: the call is then one block node over a per-instance data input instead of the
#: body's ops recorded one by one (a block call with no lazy argument runs as written).
#: Read at every call.
VALUE_PARAMS: bool = bool(_env_int("ACROBAT_VALUE_PARAMS", 1))

#: Largest number of block traces kept per ``@acrobat.block`` function (LRU).
BLOCK_CACHE_SIZE: int = _env_int("ACROBAT_BLOCK_CACHE_SIZE", 256)


@contextlib.contextmanager
def override(**flags):
    """Temporarily set flags: ``with acrobat.config.override(VERIFY=True): ...``."""
    g = globals()
    old = {}
    for key, value in flags.items():
        if key not in g or key.startswith("_") or callable(g[key]):
            raise KeyError(f"acrobat.config has no flag {key!r}")
        old[key] = g[key]
        g[key] = value
    try:
        yield
    finally:
        g.update(old)

#: In a block's generated program, ``linear(x, W_x, b_x) + linear(h, W_h, b_h)`` over two
#: block inputs nothing else reads runs as one GEMM over the inputs gathered as one
#: buffer ``[x, h]`` with the weights concatenated (codegen.joined_linears; up to
#: codegen.JOINED_WEIGHT_MAX bytes of weights). Read when a program is generated.
JOIN_LINEARS: bool = bool(_env_int("ACROBAT_JOIN_LINEARS", 1))

#: In a block's generated program, 2 to 8 linear layers reading the same value (a
#: textbook LSTM cell's per-gate layers) run as one GEMM over their stacked weights
#: (codegen.stacked_linears). Read when a program is generated.
STACK_LINEARS: bool = bool(_env_int("ACROBAT_STACK_LINEARS", 1))

#: Block inputs read only by matrix products (MV-RNN's phrase matrices) are not gathered:
#: the products read each instance's matrix where its producer wrote it, through MKL's
#: batched GEMM over address lists (acrobat/rows.py), on CPU without autograd, where
#: torch's BLAS has it. MV-RNN small b64 13.4 -> 11.2 ms (gathers 2.1 -> 0.8 ms). Off:
#: gathered like every operand (read at every batch; programs compiled while it was off
#: keep gathering).
ROW_OPERANDS: bool = bool(_env_int("ACROBAT_ROW_OPERANDS", 1))

#: A block's ``cat([a, b, ...], -1)`` of inputs that nothing else reads is gathered as one
#: buffer: each part's rows copied from their addresses straight into its columns
#: (executor._join, codegen.joined_cats) instead of a gather per part and a ``torch.cat``
#: of the copies. On CPU without autograd, with the C extension. Off: a gather per part.
JOIN_GATHERS: bool = bool(_env_int("ACROBAT_JOIN_GATHERS", 1))

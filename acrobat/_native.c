/* acrobat._native: the record hot path in C (optional; acrobat/graph.py has the same
 * code in Python and uses it when this module is not built or ACROBAT_NATIVE=0).
 *
 * What is here and why: recording one node in Python costs ~2-3 us (building the Node
 * object, its depth and phase, its bucket key, the LazyTensor handle), which is most of
 * a control-flow model's graph construction. The same steps in C cost a fraction.
 *
 *   NodeBase     graph.Node's fields (graph.Node subclasses it, adding methods only)
 *   LazyBase     tensor.LazyTensor's fields (likewise)
 *   add_node     graph.add_node: depth and phase inline, appended to its bucket
 *   record_node  graph.record after its runtime checks: signature, Info, node, outputs
 *   record_data  graph.record_data once the signature's Info exists
 *   has_lazy     graph.has_lazy
 *   block_call_impl  the fast path of a block call: key, cache hit, node, output; a
 *                block remembers its last hits in a map (BlockBase's memo) so a call
 *                keyed by the same objects skips building and hashing the key
 *   trace_hit    block.Block.trace_for's cache hit (the same key and lookup)
 *   BlockBase, AutoBase, RegionBase  C call slots of block.Block, analysis.AutoBlock and
 *                analysis.RegionBlock: the checks of their __call__ and block_call_impl, the
 *                rest in Python (_call, _region_call)
 *   column, flat_column, finish_rows, copy_rows, join_into, heights, relift: the executor's and
 *                scheduler's per-row loops
 *   row_addresses, gemm_batch  operands read in place: the rows' addresses, and MKL's
 *                batched GEMM over pointer lists (acrobat/rows.py)
 *   value_read   fibers.demand_py's common path (LazyBase.tolist, tensor.DEMAND_PY): a
 *                suspension and the read of a converted batch's row
 *   switch_away  fibers.switch_away: a blocked fiber hands over to the next ready one
 *   fiber_main   fibers._fiber_main: a fiber's run on its worker greenlet
 *   prune_dead   scheduler.prune_dead: nodes only their bucket references are dropped
 *   unneeded     scheduler.unneeded: the buckets a demand flush leaves for later
 *   Shortcut     a torch function's stand-in while a map runs: fibers.RecordMode's
 *                handler for lazy arguments without torch's mode dispatch
 *
 * Semantics are those of the Python functions named above; keep them in step (the
 * tests run both: tests/test_native.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* ---- slot caches: attributes of __slots__ classes read at their offsets ----------
 * graph.Runtime, fibers.Fiber, graph.Info, block.Trace and hoisting.Split keep their
 * fields in __slots__. PyObject_GetAttr on one costs ~100 instructions (a type lookup,
 * the member descriptor's call); each call site below remembers the type (and its
 * version tag, which changes if the type is modified) and the slot's offset, and reads
 * the field directly. Any other type, an unset slot or a name that is not a plain slot
 * takes PyObject_GetAttr / PyObject_SetAttr as before. */

typedef struct {
    PyTypeObject *type;
    unsigned int version;
    Py_ssize_t offset;  /* -1: not a plain slot of this type (use Get/SetAttr) */
} SlotCache;

static void slot_cache_fill(PyTypeObject *tp, PyObject *name, SlotCache *c) {
    c->type = NULL;
    PyObject *d = _PyType_Lookup(tp, name);  /* borrowed; no exception set */
    if (!(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return;
    c->offset = -1;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) c->offset = m->offset;
    }
    c->type = tp;
    c->version = tp->tp_version_tag;
}

static inline PyObject **slot_at(PyObject *obj, PyObject *name, SlotCache *c) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp != c->type || tp->tp_version_tag != c->version) slot_cache_fill(tp, name, c);
    if (c->type != tp || c->offset < 0) return NULL;
    return (PyObject **)((char *)obj + c->offset);
}

static inline PyObject *slot_get(PyObject *obj, PyObject *name, SlotCache *c) {
    PyObject **at = slot_at(obj, name, c);
    if (at == NULL || *at == NULL) return PyObject_GetAttr(obj, name);
    return Py_NewRef(*at);
}

static inline int slot_set(PyObject *obj, PyObject *name, PyObject *v, SlotCache *c) {
    PyObject **at = slot_at(obj, name, c);
    if (at == NULL) return PyObject_SetAttr(obj, name, v);
    Py_XSETREF(*at, Py_NewRef(v));
    return 0;
}

/* PyLong_AsLongLong for a slot: an int of one or two 30-bit digits read directly on
 * CPython 3.10/3.11 (the slots of a map are below 2**60); the generic conversion (~130
 * instructions through _PyLong_AsByteArray for a multi-digit int) otherwise */
static inline long long slot_value(PyObject *v) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(v)) {
        Py_ssize_t size = Py_SIZE(v);
        const digit *d = ((PyLongObject *)v)->ob_digit;
        if (size == 1) return (long long)d[0];
        if (size == 2) return (long long)d[0] | ((long long)d[1] << PyLong_SHIFT);
        if (size == 0) return 0;
    }
#endif
    return PyLong_AsLongLong(v);
}

#if defined(__GNUC__)
#define SLOT_GET(obj, name) \
    __extension__({ static SlotCache c_; slot_get((obj), (name), &c_); })
#define SLOT_SET(obj, name, v) \
    __extension__({ static SlotCache c_; slot_set((obj), (name), (v), &c_); })
#else
#define SLOT_GET(obj, name) PyObject_GetAttr((obj), (name))
#define SLOT_SET(obj, name, v) PyObject_SetAttr((obj), (name), (v))
#endif

/* *out = v as a Py_ssize_t, consuming the reference v (NULL: an error is set) */
static int ssize_of(PyObject *v, Py_ssize_t *out) {
    if (v == NULL) return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* *out = obj.name as a Py_ssize_t (a slot cache per call site) */
#define get_ssize(obj, name, out) ssize_of(SLOT_GET((obj), (name)), (out))

/* ---- NodeBase ------------------------------------------------------------------- */

#define HANDLE_SLOTS 4  /* outputs of a node whose handles are counted */

typedef struct {
    PyObject_HEAD
    PyObject *op, *func, *args, *kwargs, *inputs, *info, *sig, *rt, *data, *outs;
    Py_ssize_t depth, phase, instance, row, height;
    long long slot;
    int used;  /* operands of nodes recorded since that read an output (in-place ops) */
    /* How many of ``used`` read output k, for k = 1..USED_SMALL, and a dict for any later
     * k (NULL while none): Python sees both as one dict, ``used_at``. A block's node
     * whose second or third output is read (DRNN's logits by the stack of an instance's
     * nodes) made a dict each: 1,574 of them at batch 64, ~370 KB of a map's 2.5 MB. */
    uint32_t used_small[4];
    PyObject *used_at;
    char demanded;  /* a fiber has waited for its value (fibers._wait, value_read) */
    /* Output lifetimes (config.FREE_OUTPUTS): how many LazyTensors of this node exist per
     * output k < HANDLE_SLOTS, and once its batch ran, the batch's OutBlock (below). */
    uint32_t handles[HANDLE_SLOTS];
    struct OutBlock *block;
} NodeObject;

/* A batch's outputs and how many LazyTensors of each exist over all its nodes
 * (finish_rows). ``outs`` is the batch's own copy of its outputs tuple, shared by its
 * nodes; when the last handle of output k dies (and nothing pinned the batch), item k is
 * replaced by None, so its buffer goes back to the allocator while the map still runs.
 * Freed with the last node that points to it. Only the first ``width`` outputs (at most
 * HANDLE_SLOTS) are counted; later ones are never freed early. */
typedef struct OutBlock {
    Py_ssize_t refs;  /* nodes pointing here */
    Py_ssize_t width;  /* outputs counted: min(len(outs), HANDLE_SLOTS) */
    int pinned;  /* other nodes read these outputs without being counted: keep them all */
    PyObject *outs;
    Py_ssize_t live[];
} OutBlock;

/* keep_freed(list or None): while a list is set, every output released is appended to it
 * instead of going back to the allocator (config.VERIFY: executor.poison_freed fills them
 * with NaN, so a read that a handle count missed shows in the results) */
static PyObject *freed_list;

static PyObject *keep_freed(PyObject *mod, PyObject *arg) {
    if (arg != Py_None && !PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "keep_freed(list or None)");
        return NULL;
    }
    Py_XSETREF(freed_list, arg == Py_None ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* Output k < b->width has no handle left: its tensor released (the tuple keeps None). */
static void out_free(OutBlock *b, Py_ssize_t k) {
    if (b->pinned) return;
    PyObject *old = PyTuple_GET_ITEM(b->outs, k);
    if (old == Py_None) return;
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(b->outs, k, Py_None);
    if (freed_list != NULL) {  /* (maybe inside a dealloc: any exception set is kept) */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (PyList_Append(freed_list, old) < 0) PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(old);
}

/* ``nd`` leaves its block: its handles no longer count there; the block freed with the
 * last node. */
static void block_leave(NodeObject *nd) {
    OutBlock *b = nd->block;
    if (b == NULL) return;
    nd->block = NULL;
    for (Py_ssize_t k = 0; k < b->width; k++) {
        if (nd->handles[k] == 0) continue;
        b->live[k] -= nd->handles[k];
        if (b->live[k] == 0) out_free(b, k);
    }
    if (--b->refs == 0) {
        Py_DECREF(b->outs);
        PyMem_Free(b);
    }
}

/* A LazyTensor of (node, idx) made (+1) or gone (-1). */
static void handle_count(PyObject *node, PyObject *idx, int delta);

#define USED_SMALL 4

static PyTypeObject NodeType;

static int node_traverse(NodeObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->op);
    Py_VISIT(self->func);
    Py_VISIT(self->args);
    Py_VISIT(self->kwargs);
    Py_VISIT(self->inputs);
    Py_VISIT(self->info);
    Py_VISIT(self->sig);
    Py_VISIT(self->rt);
    Py_VISIT(self->data);
    Py_VISIT(self->outs);
    Py_VISIT(self->used_at);
    return 0;
}

static int node_clear(NodeObject *self) {
    Py_CLEAR(self->op);
    Py_CLEAR(self->func);
    Py_CLEAR(self->args);
    Py_CLEAR(self->kwargs);
    Py_CLEAR(self->inputs);
    Py_CLEAR(self->info);
    Py_CLEAR(self->sig);
    Py_CLEAR(self->rt);
    Py_CLEAR(self->data);
    block_leave(self);
    Py_CLEAR(self->outs);
    Py_CLEAR(self->used_at);
    return 0;
}

/* A static base type: a heap subclass's subtype_dealloc calls this, then releases the
 * subclass's reference to its type itself. */
static void node_dealloc(NodeObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, node_dealloc)  /* long chains of nodes free iteratively */
    node_clear(self);
    tp->tp_free((PyObject *)self);
    Py_TRASHCAN_END
}

/* A new node of type ``tp`` (NodeType or graph.Node), fields stolen: no Python __init__. */
static NodeObject *node_new_fields(PyTypeObject *tp, PyObject *op, PyObject *func,
                                   PyObject *args, PyObject *kwargs, PyObject *inputs,
                                   PyObject *info, PyObject *sig, Py_ssize_t depth,
                                   Py_ssize_t phase, Py_ssize_t instance, PyObject *rt) {
    NodeObject *nd = (NodeObject *)tp->tp_alloc(tp, 0);
    if (nd == NULL) return NULL;
    Py_INCREF(op); nd->op = op;
    Py_INCREF(func); nd->func = func;
    Py_INCREF(args); nd->args = args;
    Py_INCREF(kwargs); nd->kwargs = kwargs;
    Py_INCREF(inputs); nd->inputs = inputs;
    Py_INCREF(info); nd->info = info;
    Py_INCREF(sig); nd->sig = sig;
    Py_INCREF(rt); nd->rt = rt;
    Py_INCREF(Py_None); nd->data = Py_None;
    Py_INCREF(Py_None); nd->outs = Py_None;
    nd->depth = depth;
    nd->phase = phase;
    nd->instance = instance;
    nd->row = 0;
    nd->slot = 0;
    nd->height = 0;
    nd->used = 0;
    memset(nd->used_small, 0, sizeof nd->used_small);
    nd->used_at = NULL;
    nd->demanded = 0;
    return nd;
}

static int node_init(NodeObject *self, PyObject *args, PyObject *kwds) {
    PyObject *op, *func, *a, *kw, *inputs, *info, *sig, *rt;
    Py_ssize_t depth, phase, instance;
    static char *names[] = {"op", "func", "args", "kwargs", "inputs", "info", "sig",
                            "depth", "phase", "instance", "rt", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOnnnO", names, &op, &func, &a, &kw,
                                     &inputs, &info, &sig, &depth, &phase, &instance, &rt))
        return -1;
#define SETF(f, v) do { PyObject *o_ = self->f; Py_INCREF(v); self->f = v; Py_XDECREF(o_); } while (0)
    SETF(op, op);
    SETF(func, func);
    SETF(args, a);
    SETF(kwargs, kw);
    SETF(inputs, inputs);
    SETF(info, info);
    SETF(sig, sig);
    SETF(rt, rt);
    SETF(data, Py_None);
    block_leave(self);
    SETF(outs, Py_None);
    Py_CLEAR(self->used_at);
    memset(self->used_small, 0, sizeof self->used_small);
#undef SETF
    self->depth = depth;
    self->phase = phase;
    self->instance = instance;
    self->row = 0;
    self->slot = 0;
    self->height = 0;
    self->used = 0;
    self->demanded = 0;
    return 0;
}

#define NODE_OBJ(name) {#name, T_OBJECT, offsetof(NodeObject, name), 0, NULL}
static PyMemberDef node_members[] = {
    NODE_OBJ(op), NODE_OBJ(func), NODE_OBJ(args), NODE_OBJ(kwargs), NODE_OBJ(inputs),
    NODE_OBJ(info), NODE_OBJ(sig), NODE_OBJ(rt), NODE_OBJ(data), NODE_OBJ(outs),
    {"depth", T_PYSSIZET, offsetof(NodeObject, depth), 0, NULL},
    {"phase", T_PYSSIZET, offsetof(NodeObject, phase), 0, NULL},
    {"instance", T_PYSSIZET, offsetof(NodeObject, instance), 0, NULL},
    {"row", T_PYSSIZET, offsetof(NodeObject, row), 0, NULL},
    {"height", T_PYSSIZET, offsetof(NodeObject, height), 0, NULL},
    {"slot", T_LONGLONG, offsetof(NodeObject, slot), 0, NULL},
    {"used", T_INT, offsetof(NodeObject, used), 0, NULL},
    {"demanded", T_BOOL, offsetof(NodeObject, demanded), 0, NULL},
    {NULL}};

/* node.used_at: {output index > 0: readers} (a new dict), or None where no reader of a
 * later output was counted */
static PyObject *node_get_used_at(NodeObject *self, void *closure) {
    int any = self->used_at != NULL && PyDict_GET_SIZE(self->used_at) > 0;
    for (int k = 0; k < USED_SMALL; k++) any |= self->used_small[k] != 0;
    if (!any) Py_RETURN_NONE;
    PyObject *d = self->used_at != NULL ? PyDict_Copy(self->used_at) : PyDict_New();
    if (d == NULL) return NULL;
    for (int k = 0; k < USED_SMALL; k++) {  /* (added to the dict's count: mark_at puts
                                               * readers past UINT32_MAX there) */
        if (self->used_small[k] == 0) continue;
        PyObject *key = PyLong_FromLong(k + 1), *v = PyLong_FromUnsignedLong(self->used_small[k]);
        PyObject *more = key != NULL ? PyDict_GetItemWithError(d, key) : NULL;  /* borrowed */
        if (more != NULL && v != NULL) Py_SETREF(v, PyNumber_Add(v, more));
        int r = key != NULL && v != NULL && !PyErr_Occurred() ? PyDict_SetItem(d, key, v) : -1;
        Py_XDECREF(key);
        Py_XDECREF(v);
        if (r < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

/* node.used_at = None or {output index > 0: readers}: the counts replaced */
static int node_set_used_at(NodeObject *self, PyObject *value, void *closure) {
    PyObject *rest = NULL;
    uint32_t small[USED_SMALL] = {0};
    if (value != NULL && value != Py_None) {
        if (!PyDict_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "node.used_at must be a dict or None");
            return -1;
        }
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(value, &pos, &k, &v)) {
            long ik = PyLong_Check(k) ? PyLong_AsLong(k) : -1;
            long iv = PyLong_Check(v) ? PyLong_AsLong(v) : -1;
            if (PyErr_Occurred()) goto fail;
            if (ik >= 1 && ik <= USED_SMALL && iv >= 0 && iv <= (long)UINT32_MAX) {
                small[ik - 1] = (uint32_t)iv;
                continue;
            }
            if (rest == NULL && (rest = PyDict_New()) == NULL) goto fail;
            if (PyDict_SetItem(rest, k, v) < 0) goto fail;
        }
    }
    memcpy(self->used_small, small, sizeof small);
    Py_XSETREF(self->used_at, rest);
    return 0;
fail:
    Py_XDECREF(rest);
    return -1;
}

static PyGetSetDef node_getset[] = {
    {"used_at", (getter)node_get_used_at, (setter)node_set_used_at,
     "{output index > 0: how many recorded operands read it}, or None", NULL},
    {NULL}};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "acrobat._native.NodeBase",
    .tp_basicsize = sizeof(NodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "graph.Node's fields (see acrobat/graph.py)",
    .tp_traverse = (traverseproc)node_traverse,
    .tp_clear = (inquiry)node_clear,
    .tp_dealloc = (destructor)node_dealloc,
    .tp_members = node_members,
    .tp_getset = node_getset,
    .tp_init = (initproc)node_init,
    .tp_new = PyType_GenericNew,
};

/* ---- LazyBase ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *node, *idx, *shape, *dtype, *key;
} LazyObject;

static PyTypeObject LazyType;
static PyObject *lazy_tolist(PyObject *self, PyObject *unused);  /* value reads, below */
static PyObject *lazy_item(PyObject *self, PyObject *unused);
static PyObject *lazy_int(PyObject *self);
static PyObject *lazy_float(PyObject *self);
static int lazy_bool(PyObject *self);
static PyObject *type_key_fn;  /* tensor.type_key */

static int lazy_traverse(LazyObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->node);
    Py_VISIT(self->idx);
    Py_VISIT(self->shape);
    Py_VISIT(self->dtype);
    Py_VISIT(self->key);
    return 0;
}

static int lazy_clear(LazyObject *self) {
    handle_count(self->node, self->idx, -1);
    Py_CLEAR(self->node);
    Py_CLEAR(self->idx);
    Py_CLEAR(self->shape);
    Py_CLEAR(self->dtype);
    Py_CLEAR(self->key);
    return 0;
}

static void lazy_dealloc(LazyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, lazy_dealloc)
    lazy_clear(self);
    tp->tp_free((PyObject *)self);
    Py_TRASHCAN_END
}

/* ---- the subclasses' deallocation --------------------------------------------------
 * graph.Node and tensor.LazyTensor subclass NodeBase and LazyBase with methods only (no
 * __dict__, __weakref__, slots or finalizer of their own). CPython gives such a class
 * subtype_dealloc, which for a GC base untracks the object, tracks it again and calls the
 * base's dealloc (which untracks it once more), each inside a trashcan of its own: a map's
 * graph (DRNN small b64: ~3,200 nodes and ~4,400 lazy tensors) is freed at its end that
 * way. fast_dealloc(cls) gives the class a dealloc that does the same in one pass: untrack,
 * clear, free, release the class (as subtype_dealloc does for an instance of a heap type). */

static void method_subclass_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, method_subclass_dealloc)
    tp->tp_base->tp_clear(self);  /* node_clear / lazy_clear: the fields are the base's */
    tp->tp_free(self);
    Py_DECREF(tp);
    Py_TRASHCAN_END
}

/* fast_dealloc(cls): cls (a direct heap subclass of NodeBase or LazyBase adding nothing
 * that needs subtype_dealloc) gets method_subclass_dealloc; True if it did, False
 * (unchanged) for any other class. */
static PyObject *fast_dealloc(PyObject *mod, PyObject *cls) {
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "fast_dealloc(cls): a class");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)cls, *base = tp->tp_base;
    if (base != &NodeType && base != &LazyType) Py_RETURN_FALSE;
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || tp->tp_basicsize != base->tp_basicsize ||
        tp->tp_itemsize != 0 || tp->tp_dictoffset != base->tp_dictoffset ||
        tp->tp_weaklistoffset != base->tp_weaklistoffset || tp->tp_finalize != NULL ||
        tp->tp_del != NULL || tp->tp_free != base->tp_free)
        Py_RETURN_FALSE;
    tp->tp_dealloc = method_subclass_dealloc;
    Py_RETURN_TRUE;
}

static int lazy_init(LazyObject *self, PyObject *args, PyObject *kwds) {
    PyObject *node, *idx, *shape, *dtype, *key = Py_None;
    static char *names[] = {"node", "idx", "shape", "dtype", "key", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O", names, &node, &idx, &shape,
                                     &dtype, &key))
        return -1;
    if (key == Py_None) {
        key = PyObject_CallFunctionObjArgs(type_key_fn, shape, dtype, NULL);
        if (key == NULL) return -1;
    } else {
        Py_INCREF(key);
    }
    Py_INCREF(node);
    Py_INCREF(idx);
    Py_INCREF(shape);
    Py_INCREF(dtype);
    handle_count(node, idx, 1);  /* (the new handle counted before the old one is let go) */
    handle_count(self->node, self->idx, -1);
    Py_XSETREF(self->node, node);
    Py_XSETREF(self->idx, idx);
    Py_XSETREF(self->shape, shape);
    Py_XSETREF(self->dtype, dtype);
    Py_XSETREF(self->key, key);
    return 0;
}

#define LAZY_OBJ(name) {#name, T_OBJECT, offsetof(LazyObject, name), 0, NULL}
/* node and idx are read-only: the handle counts (handle_count) follow them, so a lazy
 * tensor is pointed at another output only through rebind() */
static PyMemberDef lazy_members[] = {
    {"node", T_OBJECT, offsetof(LazyObject, node), READONLY, NULL},
    {"idx", T_OBJECT, offsetof(LazyObject, idx), READONLY, NULL},
    LAZY_OBJ(shape), LAZY_OBJ(dtype), LAZY_OBJ(key), {NULL}};

/* t.rebind(node, idx): t now names output idx of node (an in-place update rebinds its
 * target to the update's result) */
static PyObject *lazy_rebind(LazyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "rebind(node, idx)");
        return NULL;
    }
    Py_INCREF(a[0]);
    Py_INCREF(a[1]);
    handle_count(a[0], a[1], 1);
    handle_count(self->node, self->idx, -1);
    Py_XSETREF(self->node, a[0]);
    Py_XSETREF(self->idx, a[1]);
    Py_RETURN_NONE;
}

static PyMethodDef lazy_methods[] = {
    {"rebind", (PyCFunction)(void (*)(void))lazy_rebind, METH_FASTCALL,
     "rebind(node, idx): name output idx of node from now on (in-place updates)."},
    {"tolist", (PyCFunction)lazy_tolist, METH_NOARGS,
     "The value as Python numbers (fibers.demand_py; suspends until it is computed)."},
    {"item", (PyCFunction)lazy_item, METH_NOARGS,
     "The value of a one-element tensor as a Python number (suspends until computed)."},
    {NULL, NULL, 0, NULL}};

/* int(t), float(t), bool(t): the read of ``item`` without a Python frame */
static PyNumberMethods lazy_number = {
    .nb_bool = (inquiry)lazy_bool,
    .nb_int = (unaryfunc)lazy_int,
    .nb_float = (unaryfunc)lazy_float,
};

static PyTypeObject LazyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "acrobat._native.LazyBase",
    .tp_basicsize = sizeof(LazyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "tensor.LazyTensor's fields (see acrobat/tensor.py)",
    .tp_traverse = (traverseproc)lazy_traverse,
    .tp_clear = (inquiry)lazy_clear,
    .tp_dealloc = (destructor)lazy_dealloc,
    .tp_members = lazy_members,
    .tp_methods = lazy_methods,
    .tp_as_number = &lazy_number,
    .tp_init = (initproc)lazy_init,
    .tp_new = PyType_GenericNew,
};

/* ---- module state: set once by graph.py through setup() --------------------------- */

static PyTypeObject *node_cls;  /* graph.Node */

/* PyObject_TypeCheck against the C bases, with the exact Python classes first (an
 * exact match skips PyType_IsSubtype's walk of the MRO) */
#define IS_LAZY(x) (Py_TYPE(x) == lazy_cls || PyObject_TypeCheck((x), &LazyType))
#define IS_NODE(x) (Py_TYPE(x) == node_cls || PyObject_TypeCheck((x), &NodeType))
static PyTypeObject *lazy_cls;  /* tensor.LazyTensor */

static void handle_count(PyObject *node, PyObject *idx, int delta) {
    if (node == NULL || idx == NULL || !PyLong_CheckExact(idx) || !IS_NODE(node)) return;
    int overflow = 0;  /* (no exception for an exact int: safe inside a dealloc) */
    long k = PyLong_AsLongAndOverflow(idx, &overflow);
    if (overflow || k < 0 || k >= HANDLE_SLOTS) return;
    NodeObject *nd = (NodeObject *)node;
    if (delta > 0) {
        nd->handles[k]++;
    } else if (nd->handles[k] > 0) {
        nd->handles[k]--;
    } else {
        return;
    }
    OutBlock *b = nd->block;
    if (b == NULL || k >= b->width) return;
    b->live[k] += delta;
    if (b->live[k] == 0) out_free(b, k);
}
static PyObject *check_inputs_fn;  /* graph._check_inputs */
static PyObject *config_mod;    /* acrobat.config (ALIGN_WINDOW) */
static PyObject *zero;          /* the int 0 */
static PyObject *one;           /* the int 1 */

static PyObject *s_sig;
static PyObject *s_grad, *s_grad_resume;  /* Fiber.grad (a GradTag or None), rt.grad_resume */
static PyObject *s_fiber, *s_phase, *s_instance, *s_buckets, *s_nodes, *s_ALIGN_WINDOW,
    *s_metas, *s_keys, *s_single, *s_struct, *s_plain_tuple;

static PyObject *setup(PyObject *mod, PyObject *args) {
    PyObject *nc, *lc, *ci, *cfg, *tk;
    if (!PyArg_ParseTuple(args, "OOOOO", &nc, &lc, &ci, &cfg, &tk)) return NULL;
    if (!PyType_Check(nc) || !PyType_IsSubtype((PyTypeObject *)nc, &NodeType) ||
        !PyType_Check(lc) || !PyType_IsSubtype((PyTypeObject *)lc, &LazyType)) {
        PyErr_SetString(PyExc_TypeError, "setup: Node and LazyTensor must subclass the bases");
        return NULL;
    }
    Py_INCREF(nc); Py_XSETREF(node_cls, (PyTypeObject *)nc);
    Py_INCREF(lc); Py_XSETREF(lazy_cls, (PyTypeObject *)lc);
    Py_INCREF(ci); Py_XSETREF(check_inputs_fn, ci);
    Py_INCREF(cfg); Py_XSETREF(config_mod, cfg);
    Py_INCREF(tk); Py_XSETREF(type_key_fn, tk);
    Py_RETURN_NONE;
}

/* ---- _enqueue -------------------------------------------------------------------- */

static PyObject *bucket_key(Py_ssize_t phase, Py_ssize_t depth, PyObject *sig) {
    PyObject *key = PyTuple_New(3);
    if (key == NULL) return NULL;
    PyObject *p = PyLong_FromSsize_t(phase), *d = PyLong_FromSsize_t(depth);
    if (p == NULL || d == NULL) {
        Py_XDECREF(p);
        Py_XDECREF(d);
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, p);
    PyTuple_SET_ITEM(key, 1, d);
    Py_INCREF(sig);
    PyTuple_SET_ITEM(key, 2, sig);
    return key;
}

/* The buckets the last nodes went to: a node of the same (phase, depth, signature
 * object) as one of them, while rt.buckets is unchanged (its version tag: a new bucket or
 * a flush's pops change it), goes to the same list without building and hashing the key
 * (a tuple holding the signature's nested tuples). Keys are borrowed: the unchanged dict
 * holds them and the lists. */
#if PY_VERSION_HEX < 0x030C0000
#define BUCKET_MEMO 8
static struct {
    PyObject *dict, *sig, *list;
    uint64_t version;
    Py_ssize_t phase, depth, to_depth;
} bucket_memo[BUCKET_MEMO];

static inline size_t bucket_slot(NodeObject *nd, Py_ssize_t depth) {
    return (((uintptr_t)nd->sig >> 4) ^ (size_t)depth * 31 ^ (size_t)nd->phase) % BUCKET_MEMO;
}
#endif

/* graph._enqueue: append to the (phase, depth, sig) bucket, or the nearest later bucket
 * of that signature within ALIGN_WINDOW levels (moving the node there). */
static int enqueue(PyObject *rt, NodeObject *nd) {
    PyObject *buckets = SLOT_GET(rt, s_buckets);
    if (buckets == NULL) return -1;
    if (!PyDict_CheckExact(buckets)) {
        PyErr_SetString(PyExc_TypeError, "rt.buckets must be a dict");
        Py_DECREF(buckets);
        return -1;
    }
#ifdef BUCKET_MEMO
    Py_ssize_t asked = nd->depth;
    size_t slot = bucket_slot(nd, asked);
    if (bucket_memo[slot].dict == buckets && bucket_memo[slot].sig == nd->sig &&
        bucket_memo[slot].depth == asked && bucket_memo[slot].phase == nd->phase &&
        bucket_memo[slot].version == ((PyDictObject *)buckets)->ma_version_tag) {
        nd->depth = bucket_memo[slot].to_depth;
        int r = PyList_Append(bucket_memo[slot].list, (PyObject *)nd);
        Py_DECREF(buckets);
        return r;
    }
#endif
    PyObject *key = bucket_key(nd->phase, nd->depth, nd->sig);
    if (key == NULL) goto fail;
    PyObject *bucket = PyDict_GetItemWithError(buckets, key);  /* borrowed */
    if (bucket == NULL && PyErr_Occurred()) goto fail_key;
    if (bucket == NULL && nd->depth) {
        PyObject *w = PyObject_GetAttr(config_mod, s_ALIGN_WINDOW);
        if (w == NULL) goto fail_key;
        Py_ssize_t window = PyObject_IsTrue(w) ? PyLong_AsSsize_t(w) : 0;
        Py_DECREF(w);
        if (window == -1 && PyErr_Occurred()) goto fail_key;
        for (Py_ssize_t d = nd->depth + 1; d <= nd->depth + window; d++) {
            PyObject *k2 = bucket_key(nd->phase, d, nd->sig);
            if (k2 == NULL) goto fail_key;
            bucket = PyDict_GetItemWithError(buckets, k2);
            Py_DECREF(k2);
            if (bucket != NULL) {
                nd->depth = d;
                break;
            }
            if (PyErr_Occurred()) goto fail_key;
        }
    }
    if (bucket == NULL) {
        PyObject *lst = PyList_New(1);
        if (lst == NULL) goto fail_key;
        Py_INCREF(nd);
        PyList_SET_ITEM(lst, 0, (PyObject *)nd);
        int r = PyDict_SetItem(buckets, key, lst);
        bucket = lst;  /* (borrowed: the dict holds it) */
        Py_DECREF(lst);
        if (r < 0) goto fail_key;
    } else if (PyList_Append(bucket, (PyObject *)nd) < 0) {
        goto fail_key;
    }
#ifdef BUCKET_MEMO
    bucket_memo[slot].dict = buckets;
    bucket_memo[slot].sig = nd->sig;
    bucket_memo[slot].list = bucket;
    bucket_memo[slot].version = ((PyDictObject *)buckets)->ma_version_tag;
    bucket_memo[slot].phase = nd->phase;
    bucket_memo[slot].depth = asked;
    bucket_memo[slot].to_depth = nd->depth;
#endif
    Py_DECREF(key);
    Py_DECREF(buckets);
    return 0;  /* (rt.nodes: counted by scheduler.schedule as it pops the buckets) */
fail_key:
    Py_DECREF(key);
fail:
    Py_DECREF(buckets);
    return -1;
}

/* ---- add_node -------------------------------------------------------------------- */

static PyObject *s_deferred;

/* producer.used_at[ix] += 1: a reader of output ``ix`` (> 0) of a node with several */
static int mark_at(NodeObject *producer, PyObject *ix) {
    if (ix == NULL) return 0;
    Py_ssize_t k = PyLong_AsSsize_t(ix);
    if (k == -1 && PyErr_Occurred()) return -1;
    if (k == 0) return 0;
    if (k >= 1 && k <= USED_SMALL && producer->used_small[k - 1] < UINT32_MAX) {
        producer->used_small[k - 1] += 1;
        return 0;
    }
    if (producer->used_at == NULL) {  /* (a later output, or a count past UINT32_MAX) */
        producer->used_at = PyDict_New();
        if (producer->used_at == NULL) return -1;
    }
    PyObject *c = PyDict_GetItemWithError(producer->used_at, ix);
    if (c == NULL && PyErr_Occurred()) return -1;
    PyObject *c1 = c == NULL ? (Py_INCREF(one), one) : PyNumber_Add(c, one);
    if (c1 == NULL) return -1;
    int r = PyDict_SetItem(producer->used_at, ix, c1);
    Py_DECREF(c1);
    return r;
}

/* graph.queue of a deferred data node (depth graph.DEFERRED, -1): one fewer deferred,
 * into its depth-0 bucket (MV-RNN's word ids, once per leaf: the Python call cost
 * ~0.5 us each) */
static int queue_deferred(PyObject *rt, NodeObject *nd) {
    if (nd->depth == -1) {
        PyObject *d = SLOT_GET(rt, s_deferred);
        if (d == NULL) return -1;
        PyObject *d1 = PyNumber_Subtract(d, one);
        Py_DECREF(d);
        if (d1 == NULL) return -1;
        int r = SLOT_SET(rt, s_deferred, d1);
        Py_DECREF(d1);
        if (r < 0) return -1;
    }
    nd->depth = 0;
    return enqueue(rt, nd);
}


static NodeObject *add_node_untagged(PyObject *rt, PyObject *op, PyObject *func,
                                     PyObject *args, PyObject *kwargs, PyObject *inputs,
                                     PyObject *info, PyObject *sig, PyObject *fiber);

/* graph.add_node; ``inputs`` is a list of LazyTensors; ``fiber`` rt.fiber if the caller
 * has it, else NULL. Returns a new reference. A node recorded by a fiber inside a
 * grad-mode region of its own (fibers._set_grad_enabled: fiber.grad is a GradTag) gets
 * the signature (tag, sig), so it batches apart and runs in that mode (executor.execute) */
static NodeObject *add_node_impl(PyObject *rt, PyObject *op, PyObject *func, PyObject *args,
                                 PyObject *kwargs, PyObject *inputs, PyObject *info,
                                 PyObject *sig, PyObject *fiber) {
    PyObject *f = fiber != NULL ? Py_NewRef(fiber) : SLOT_GET(rt, s_fiber);
    if (f == NULL) return NULL;
    PyObject *grad = SLOT_GET(f, s_grad), *tagged = NULL;
    NodeObject *nd = NULL;
    if (grad == NULL) goto done;
    if (grad != Py_None && (tagged = PyTuple_Pack(2, grad, sig)) == NULL) goto done;
    nd = add_node_untagged(rt, op, func, args, kwargs, inputs, info,
                           tagged != NULL ? tagged : sig, f);
done:
    Py_XDECREF(tagged);
    Py_XDECREF(grad);
    Py_DECREF(f);
    return nd;
}

/* add_node_impl's node, its signature final; ``fiber`` rt.fiber */
static NodeObject *add_node_untagged(PyObject *rt, PyObject *op, PyObject *func,
                                     PyObject *args, PyObject *kwargs, PyObject *inputs,
                                     PyObject *info, PyObject *sig, PyObject *fiber) {
    if (!PyList_CheckExact(inputs) && !PyTuple_CheckExact(inputs)) {
        PyErr_SetString(PyExc_TypeError, "add_node: inputs must be a list or a tuple");
        return NULL;
    }
    Py_INCREF(fiber);
    Py_ssize_t phase, instance;
    if (get_ssize(fiber, s_phase, &phase) < 0 || get_ssize(fiber, s_instance, &instance) < 0) {
        Py_DECREF(fiber);
        return NULL;
    }
    Py_DECREF(fiber);
    Py_ssize_t depth = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(inputs, i);
        if (!IS_LAZY(t)) {
            PyErr_SetString(PyExc_TypeError, "add_node: an input is not a LazyTensor");
            return NULL;
        }
        PyObject *p = ((LazyObject *)t)->node;
        if (p == NULL || !IS_NODE(p)) {
            PyErr_SetString(PyExc_TypeError, "add_node: an input's producer is not a Node");
            return NULL;
        }
        NodeObject *producer = (NodeObject *)p;
        producer->used += 1;  /* (a count of the reading operands: ops._readers_within) */
        PyObject *ix = ((LazyObject *)t)->idx;
        if (ix != zero && mark_at(producer, ix) < 0) return NULL;
        if (producer->depth < 0 && queue_deferred(rt, producer) < 0)
            return NULL;  /* (a deferred constant: its value is needed after all) */
        if (producer->outs != NULL && producer->outs != Py_None) {
            if (producer->rt != rt) {
                PyObject *r = PyObject_CallFunctionObjArgs(check_inputs_fn, inputs, rt, NULL);
                if (r == NULL) return NULL;
                Py_DECREF(r);
            }
            continue;
        }
        Py_ssize_t pp = producer->phase;
        if (pp == phase) {
            if (producer->depth > depth) depth = producer->depth;
        } else if (pp > phase) {
            phase = pp;
            depth = producer->depth;
        }
    }
    /* a node's operands never change once recorded (but by _give_old, which rebuilds
     * them): kept as a tuple, one block instead of a list's two (3,276 nodes a DRNN map
     * at b64, freed with its graph) */
    PyObject *operands = PyTuple_CheckExact(inputs) ? Py_NewRef(inputs) : PyList_AsTuple(inputs);
    if (operands == NULL) return NULL;
    NodeObject *nd = node_new_fields(node_cls, op, func, args, kwargs, operands, info, sig,
                                     depth + 1, phase, instance, rt);
    Py_DECREF(operands);
    if (nd == NULL) return NULL;
    if (enqueue(rt, nd) < 0) {
        Py_DECREF(nd);
        return NULL;
    }
    return nd;
}

static PyObject *add_node(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 8) {
        PyErr_SetString(PyExc_TypeError, "add_node takes 8 arguments");
        return NULL;
    }
    if (node_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup was not called");
        return NULL;
    }
    return (PyObject *)add_node_impl(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], NULL);
}

/* ---- one-output handle ------------------------------------------------------------ */

static PyObject *new_lazy(PyObject *node, PyObject *idx, PyObject *shape, PyObject *dtype,
                          PyObject *key) {
    LazyObject *t = (LazyObject *)lazy_cls->tp_alloc(lazy_cls, 0);
    if (t == NULL) return NULL;
    Py_INCREF(node); t->node = node;
    Py_INCREF(idx); t->idx = idx;
    handle_count(node, idx, 1);
    Py_INCREF(shape); t->shape = shape;
    Py_INCREF(dtype); t->dtype = dtype;
    Py_INCREF(key); t->key = key;
    return (PyObject *)t;
}

/* LazyTensor(node, k, *metas[k], keys[k]): output k's handle (metas and keys are an
 * Info's tuples, at least k + 1 long). */
static PyObject *lazy_k(PyObject *node, PyObject *metas, PyObject *keys, Py_ssize_t k) {
    PyObject *mk = PyTuple_GET_ITEM(metas, k);
    if (!PyTuple_CheckExact(mk) || PyTuple_GET_SIZE(mk) != 2) {
        PyErr_SetString(PyExc_TypeError, "info.metas[k] must be (shape, dtype)");
        return NULL;
    }
    PyObject *idx = PyLong_FromSsize_t(k);  /* a cached small int */
    if (idx == NULL) return NULL;
    PyObject *t = new_lazy(node, idx, PyTuple_GET_ITEM(mk, 0), PyTuple_GET_ITEM(mk, 1),
                           PyTuple_GET_ITEM(keys, k));
    Py_DECREF(idx);
    return t;
}

/* An Info's (metas, keys) as new references, checked to be tuples of one length of at
 * least ``least``; 0, or -1 with an exception. */
static int info_tuples(PyObject *info, Py_ssize_t least, PyObject **metas, PyObject **keys) {
    *metas = SLOT_GET(info, s_metas);
    if (*metas == NULL) return -1;
    *keys = SLOT_GET(info, s_keys);
    if (*keys == NULL) {
        Py_CLEAR(*metas);
        return -1;
    }
    if (!PyTuple_CheckExact(*metas) || !PyTuple_CheckExact(*keys) ||
        PyTuple_GET_SIZE(*metas) != PyTuple_GET_SIZE(*keys) ||
        PyTuple_GET_SIZE(*metas) < least) {
        PyErr_SetString(PyExc_TypeError,
                        "info.metas and info.keys must be tuples of one length, with outputs");
        Py_CLEAR(*metas);
        Py_CLEAR(*keys);
        return -1;
    }
    return 0;
}

/* LazyTensor(node, 0, *info.metas[0], info.keys[0]) */
static PyObject *lazy1(PyObject *node, PyObject *info) {
    PyObject *metas, *keys;
    if (info_tuples(info, 1, &metas, &keys) < 0) return NULL;
    PyObject *out = lazy_k(node, metas, keys, 0);
    Py_DECREF(metas);
    Py_DECREF(keys);
    return out;
}

/* tuple(LazyTensor(node, k, *info.metas[k], info.keys[k]) for every output k): a
 * multi-output node's outputs when they are a plain tuple (info.struct is None); NULL
 * without an exception when they are not. */
static PyObject *lazy_all(PyObject *node, PyObject *info) {
    PyObject *st = SLOT_GET(info, s_struct);
    if (st == NULL) return NULL;
    int plain = st == Py_None;
    Py_DECREF(st);
    if (!plain) return NULL;
    PyObject *metas, *keys;
    if (info_tuples(info, 0, &metas, &keys) < 0) return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(metas);
    PyObject *out = PyTuple_New(m);
    for (Py_ssize_t k = 0; out != NULL && k < m; k++) {
        PyObject *t = lazy_k(node, metas, keys, k);
        if (t == NULL)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, k, t);
    }
    Py_DECREF(metas);
    Py_DECREF(keys);
    return out;
}

/* lazy_range(node, start, stop, step, shape, dtype, key): [LazyTensor(node, i, shape,
 * dtype, key) for i in range(start, stop, step)] (a loop's per-step outputs). */
static PyObject *lazy_range(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 7) {
        PyErr_SetString(PyExc_TypeError, "lazy_range(node, start, stop, step, shape, dtype, key)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(a[1]), stop = PyLong_AsSsize_t(a[2]),
               step = PyLong_AsSsize_t(a[3]);
    if (PyErr_Occurred()) return NULL;
    if (step <= 0) {
        PyErr_SetString(PyExc_ValueError, "lazy_range: step must be positive");
        return NULL;
    }
    Py_ssize_t m = stop > start ? (stop - start + step - 1) / step : 0;
    PyObject *out = PyList_New(m);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *idx = PyLong_FromSsize_t(start + i * step);
        if (idx == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *t = new_lazy(a[0], idx, a[4], a[5], a[6]);
        Py_DECREF(idx);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

/* ---- record: graph.record after its runtime checks ------------------------------- */

static PyObject *freeze_fn;         /* graph.freeze */
static PyObject *freeze_kwargs_fn;  /* graph.freeze_kwargs */
static PyObject *copy_lists_fn;     /* graph.copy_lists */
static PyObject *infer_fn;          /* graph.infer */
static PyObject *wrap_outputs_fn;   /* graph.wrap_outputs */

/* Whether ``x`` is a list, or a tuple holding one: an argument the instance may change
 * after the call, which the node must not see (graph.copy_lists) */
static inline int holds_list(PyObject *x) {
    if (PyList_CheckExact(x)) return 1;
    if (PyTuple_CheckExact(x)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(x); i++)
            if (PyList_CheckExact(PyTuple_GET_ITEM(x, i))) return 1;
    }
    return 0;
}
static PyObject *s_sig_info;

/* The outputs of ``node``: lazy1 for one output, else graph.wrap_outputs. */
static PyObject *outputs_of(PyObject *node, PyObject *info) {
    PyObject *single = SLOT_GET(info, s_single);
    if (single == NULL) return NULL;
    int one = PyObject_IsTrue(single);
    Py_DECREF(single);
    if (one < 0) return NULL;
    if (one) return lazy1(node, info);
    PyObject *all = lazy_all(node, info);
    if (all != NULL || PyErr_Occurred()) return all;
    return PyObject_CallFunctionObjArgs(wrap_outputs_fn, node, info, NULL);
}

/* record_node(rt, op, func, args, kwargs): graph.signature, the Info of the signature
 * (graph.infer on a miss), graph.add_node, the outputs. */
static PyObject *record_node(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyTuple_Check(a[3])) {
        PyErr_SetString(PyExc_TypeError, "record_node(rt, op, func, args: tuple, kwargs)");
        return NULL;
    }
    PyObject *rt = a[0], *op = a[1], *func = a[2], *args = a[3], *kwargs = a[4];
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    PyObject *inputs = PyList_New(0), *parts = NULL, *sig = NULL, *sig_info = NULL,
             *info = NULL, *out = NULL;
    NodeObject *nd = NULL;
    PyObject *copied = NULL;  /* (args, kwargs) with their lists copied, where any */
    int lists = 0;
    if (inputs == NULL) return NULL;
    parts = PyTuple_New(nargs);
    if (parts == NULL) goto done;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *x = PyTuple_GET_ITEM(args, i), *part;
        if (Py_TYPE(x) == lazy_cls) {
            if (PyList_Append(inputs, x) < 0) goto done;
            part = ((LazyObject *)x)->key;
            Py_INCREF(part);
        } else if (PyLong_CheckExact(x) || x == Py_None) {
            part = x;
            Py_INCREF(part);
        } else {
            lists |= holds_list(x);
            part = PyObject_CallFunctionObjArgs(freeze_fn, x, inputs, NULL);
            if (part == NULL) goto done;
        }
        PyTuple_SET_ITEM(parts, i, part);
    }
    int has_kwargs = kwargs != Py_None && PyObject_IsTrue(kwargs);
    if (has_kwargs < 0) goto done;
    if (has_kwargs && PyDict_Check(kwargs)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kwargs, &pos, &k, &v)) lists |= holds_list(v);
    }
    if (lists) {  /* the node keeps copies: x[chosen], then chosen.append(i) */
        copied = PyObject_CallFunctionObjArgs(copy_lists_fn, args, kwargs, NULL);
        if (copied == NULL) goto done;
        args = PyTuple_GET_ITEM(copied, 0);
        kwargs = PyTuple_GET_ITEM(copied, 1);
    }
    if (has_kwargs) {
        PyObject *kw = PyObject_CallFunctionObjArgs(freeze_kwargs_fn, kwargs, inputs, NULL);
        if (kw == NULL) goto done;
        sig = PyTuple_Pack(3, func, parts, kw);
        Py_DECREF(kw);
    } else {
        sig = PyTuple_Pack(2, func, parts);
    }
    if (sig == NULL) goto done;
    sig_info = SLOT_GET(rt, s_sig_info);
    if (sig_info == NULL) goto done;
    info = PyDict_GetItemWithError(sig_info, sig);
    if (info != NULL) {
        Py_INCREF(info);
    } else {
        if (PyErr_Occurred()) goto done;
        info = PyObject_CallFunctionObjArgs(infer_fn, op, func, args, kwargs, rt, NULL);
        if (info == NULL || PyDict_SetItem(sig_info, sig, info) < 0) goto done;
    }
    nd = add_node_impl(rt, op, func, args, kwargs, inputs, info, sig, NULL);
    if (nd == NULL) goto done;
    out = outputs_of((PyObject *)nd, info);
done:
    Py_XDECREF(nd);
    Py_XDECREF(info);
    Py_XDECREF(sig_info);
    Py_XDECREF(sig);
    Py_XDECREF(parts);
    Py_XDECREF(copied);
    Py_DECREF(inputs);
    return out;
}

/* record_data(rt, op, sig, data, shape, dtype, deferred): graph.record_data when the
 * signature's Info exists (None otherwise: the Python function makes it). */

static PyObject *record_data_impl(PyObject *rt, PyObject *op, PyObject *sig, PyObject *data,
                                  int deferred);

static PyObject *record_data(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "record_data(rt, op, sig, data, shape, dtype, deferred)");
        return NULL;
    }
    int deferred = PyObject_IsTrue(a[6]);
    if (deferred < 0) return NULL;
    return record_data_impl(a[0], a[1], a[2], a[3], deferred);
}

/* graph.record_data once the signature's Info exists; None when it does not */
static PyObject *record_data_impl(PyObject *rt, PyObject *op, PyObject *sig, PyObject *data,
                                  int deferred) {
    PyObject *sig_info = SLOT_GET(rt, s_sig_info);
    if (sig_info == NULL) return NULL;
    PyObject *info = PyDict_Check(sig_info) ? PyDict_GetItemWithError(sig_info, sig) : NULL;
    Py_XINCREF(info);
    Py_DECREF(sig_info);
    if (info == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = NULL, *empty = PyTuple_New(0), *fiber = NULL;
    NodeObject *nd = NULL;
    Py_ssize_t phase, instance;
    if (empty == NULL) goto done;
    fiber = SLOT_GET(rt, s_fiber);
    if (fiber == NULL) goto done;
    if (get_ssize(fiber, s_phase, &phase) < 0 || get_ssize(fiber, s_instance, &instance) < 0)
        goto done;
    nd = node_new_fields(node_cls, op, Py_None, empty, Py_None, empty, info, sig, 0, phase,
                         instance, rt);
    if (nd == NULL) goto done;
    Py_INCREF(data);
    Py_XSETREF(nd->data, data);
    if (deferred) {
        nd->depth = -1;  /* graph.DEFERRED: queued when something needs the value */
        PyObject *d = SLOT_GET(rt, s_deferred);
        if (d == NULL) goto done;
        PyObject *d1 = PyNumber_Add(d, one);
        Py_DECREF(d);
        if (d1 == NULL) goto done;
        int r = SLOT_SET(rt, s_deferred, d1);
        Py_DECREF(d1);
        if (r < 0) goto done;
    } else if (enqueue(rt, nd) < 0) {
        goto done;
    }
    out = lazy1((PyObject *)nd, info);
done:
    Py_XDECREF(nd);
    Py_XDECREF(fiber);
    Py_XDECREF(empty);
    Py_DECREF(info);
    return out;
}

/* ---- block calls: block.Block.__call__ when its trace cache hits ----------------- */

static PyObject *key_fn;       /* block._key */
static PyObject *finish_fn;    /* block._finish_call(trace, node, inputs) */
static PyObject *split_fn;     /* hoisting.split_call */
static PyObject *miss;         /* block._MISS: "take the Python path" */
static PyObject *s_split_on, *s_splits, *s_memo, *s_arg_pos, *s_var;
static PyObject *s_cache, *s_factory_keys, *s_id, *s_run_id, *s_may_split, *s_op,
    *s_info, *s_out_spec, *s_leaf;

/* hoisting.split_call when the trace is cut and the cut argument's hoisted part was
 * recorded earlier in this map (every call but the first per argument): the node of the
 * rest. NULL without an exception: take hoisting.split_call. */
static PyObject *split_hit(PyObject *rt, PyObject *trace, PyObject *inputs, PyObject *tinfo) {
    PyObject *split_on = NULL, *splits = NULL, *split = NULL, *v = NULL, *rid = NULL,
             *memo_d = NULL, *pos = NULL, *var = NULL, *vop = NULL, *vsig = NULL,
             *var_inputs = NULL, *out = NULL;
    split_on = SLOT_GET(trace, s_split_on);
    if (split_on == NULL || !PyTuple_Check(split_on) || PyTuple_GET_SIZE(split_on) != 1)
        goto done;
    splits = SLOT_GET(trace, s_splits);
    if (splits == NULL || !PyDict_Check(splits)) goto done;
    split = PyDict_GetItemWithError(splits, PyTuple_GET_ITEM(split_on, 0));
    if (split == NULL) goto done;
    Py_INCREF(split);
    Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(split_on, 0));
    if (k == -1 && PyErr_Occurred()) goto done;
    if (k < 0 || k >= PyList_GET_SIZE(inputs)) goto done;
    v = SLOT_GET(split, s_run_id);
    if (v == NULL) goto done;
    rid = SLOT_GET(rt, s_id);
    if (rid == NULL) goto done;
    int same = PyObject_RichCompareBool(v, rid, Py_EQ);
    if (same != 1) goto done;
    memo_d = SLOT_GET(split, s_memo);
    if (memo_d == NULL || !PyDict_Check(memo_d)) goto done;
    PyObject *ident = PyLong_FromVoidPtr(PyList_GET_ITEM(inputs, k));
    if (ident == NULL) goto done;
    PyObject *entry = PyDict_GetItemWithError(memo_d, ident);  /* borrowed */
    Py_DECREF(ident);
    /* (the argument, its node and output index when recorded, the hoisted outputs): a
     * handle an in-place update rebound since takes the Python path, which records anew */
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) goto done;
    PyObject *arg = PyList_GET_ITEM(inputs, k);
    if (!IS_LAZY(arg) || ((LazyObject *)arg)->node != PyTuple_GET_ITEM(entry, 1)) goto done;
    int same_idx = PyObject_RichCompareBool(((LazyObject *)arg)->idx, PyTuple_GET_ITEM(entry, 2),
                                            Py_EQ);
    if (same_idx != 1) goto done;
    PyObject *memo = PyTuple_GET_ITEM(entry, 3);
    if (!PyTuple_Check(memo)) goto done;
    pos = SLOT_GET(split, s_arg_pos);
    if (pos == NULL || !PyTuple_Check(pos)) goto done;
    Py_ssize_t np = PyTuple_GET_SIZE(pos), nm = PyTuple_GET_SIZE(memo);
    var_inputs = PyList_New(np + nm);
    if (var_inputs == NULL) goto done;
    for (Py_ssize_t i = 0; i < np; i++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(pos, i));
        if (j == -1 && PyErr_Occurred()) goto done;
        if (j < 0 || j >= PyList_GET_SIZE(inputs)) {
            PyErr_SetString(PyExc_IndexError, "split_hit: argument position out of range");
            goto done;
        }
        PyObject *x = PyList_GET_ITEM(inputs, j);
        Py_INCREF(x);
        PyList_SET_ITEM(var_inputs, i, x);
    }
    for (Py_ssize_t i = 0; i < nm; i++) {
        PyObject *x = PyTuple_GET_ITEM(memo, i);
        Py_INCREF(x);
        PyList_SET_ITEM(var_inputs, np + i, x);
    }
    var = SLOT_GET(split, s_var);
    if (var == NULL) goto done;
    vop = SLOT_GET(var, s_op);
    if (vop == NULL) goto done;
    vsig = SLOT_GET(var, s_sig);
    if (vsig == NULL) goto done;
    out = (PyObject *)add_node_impl(rt, vop, Py_None, Py_None, Py_None, var_inputs, tinfo, vsig,
                                    NULL);
done:
    if (out == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_AttributeError))
        PyErr_Clear();  /* not the shape this fast path knows: the Python path decides */
    Py_XDECREF(split_on);
    Py_XDECREF(splits);
    Py_XDECREF(split);
    Py_XDECREF(v);
    Py_XDECREF(rid);
    Py_XDECREF(memo_d);
    Py_XDECREF(pos);
    Py_XDECREF(var);
    Py_XDECREF(vop);
    Py_XDECREF(vsig);
    Py_XDECREF(var_inputs);
    return out;
}

/* ---- the last hits of a block's trace cache --------------------------------------
 * A call's cache key is built from its arguments (a LazyTensor's shape-and-dtype key, a
 * module or constant by identity, numbers by value) and hashed: ~1,500 instructions a
 * call, the largest part of a block call. A block (BlockBase) remembers its last
 * MEMO_WAYS hits in the running map: the object that keyed each argument (a
 * LazyTensor's key object, else the argument itself; strong references) and the trace.
 * A call whose arguments key by the same objects has the same key, so it takes that
 * trace after a comparison of pointers. Calls with a tuple, list or dict argument (keyed
 * by structure) always build the key. Entries hold the map's id (rt.id: a trace found
 * valid in a map stays valid in it) and are dropped when the map ends (clear_memos:
 * they must not keep a model or a map's constants alive). */

#define MEMO_ARGS 8
#define MEMO_WAYS 4

typedef struct {
    PyObject *trace;  /* NULL: empty */
    long long run;
    Py_ssize_t nargs;
    PyObject *parts[MEMO_ARGS];
} MemoEntry;

typedef struct {
    PyObject_HEAD
    MemoEntry memo[MEMO_WAYS];
    int next;  /* the entry the next store replaces */
} BlockBaseObject;

static PyTypeObject BlockBaseType;
static PyObject *s_memo_blocks;

static void memo_clear_entry(MemoEntry *e) {
    Py_CLEAR(e->trace);
    for (Py_ssize_t i = 0; i < e->nargs; i++) Py_CLEAR(e->parts[i]);
    e->nargs = 0;
    e->run = -1;
}

static int blockbase_traverse(BlockBaseObject *self, visitproc visit, void *arg) {
    for (int w = 0; w < MEMO_WAYS; w++) {
        Py_VISIT(self->memo[w].trace);
        for (Py_ssize_t i = 0; i < self->memo[w].nargs; i++) Py_VISIT(self->memo[w].parts[i]);
    }
    return 0;
}

static int blockbase_clear(BlockBaseObject *self) {
    for (int w = 0; w < MEMO_WAYS; w++) memo_clear_entry(&self->memo[w]);
    return 0;
}

static void blockbase_dealloc(BlockBaseObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    blockbase_clear(self);
    tp->tp_free((PyObject *)self);
}

static inline PyObject *memo_part(PyObject *x) {
    return Py_TYPE(x) == lazy_cls ? ((LazyObject *)x)->key : x;
}

/* PyObject_TypeCheck(b, &BlockBaseType), the last class that passed first (held) */
static PyTypeObject *block_cls;

static inline int is_block(PyObject *b) {
    if (Py_TYPE(b) == block_cls) return 1;
    if (!PyObject_TypeCheck(b, &BlockBaseType)) return 0;
    Py_INCREF(Py_TYPE(b));
    Py_XSETREF(block_cls, Py_TYPE(b));
    return 1;
}

/* the remembered trace of a call of ``b`` with ``args`` in map ``run`` (a new reference;
 * *inputs_out its LazyTensor operands), or NULL (with an exception on error) */
static PyObject *memo_lookup(BlockBaseObject *b, PyObject *args, long long run,
                             PyObject **inputs_out) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (int w = 0; w < MEMO_WAYS; w++) {
        MemoEntry *e = &b->memo[w];
        if (e->trace == NULL || e->run != run || e->nargs != n) continue;
        Py_ssize_t i = 0;
        while (i < n && memo_part(PyTuple_GET_ITEM(args, i)) == e->parts[i]) i++;
        if (i < n) continue;
        Py_ssize_t k = 0;  /* (a tuple: the node keeps it as its operands) */
        for (i = 0; i < n; i++) k += Py_TYPE(PyTuple_GET_ITEM(args, i)) == lazy_cls;
        PyObject *inputs = PyTuple_New(k);
        if (inputs == NULL) return NULL;
        for (i = 0, k = 0; i < n; i++) {
            PyObject *x = PyTuple_GET_ITEM(args, i);
            if (Py_TYPE(x) == lazy_cls) PyTuple_SET_ITEM(inputs, k++, Py_NewRef(x));
        }
        *inputs_out = inputs;
        return Py_NewRef(e->trace);
    }
    return NULL;
}

/* remember that a call of ``b`` with ``args`` found ``trace`` in map ``rt`` (``run``);
 * the block is entered in rt.memo_blocks when it is its first entry of this map */
static int memo_store(BlockBaseObject *b, PyObject *args, long long run, PyObject *trace,
                      PyObject *rt) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTypeObject *tp = Py_TYPE(PyTuple_GET_ITEM(args, i));
        if (tp == &PyTuple_Type || tp == &PyList_Type || tp == &PyDict_Type) return 0;
    }
    int first = 1;
    for (int w = 0; w < MEMO_WAYS; w++)
        if (b->memo[w].trace != NULL && b->memo[w].run == run) first = 0;
    if (first) {
        PyObject *blocks = SLOT_GET(rt, s_memo_blocks);
        if (blocks == NULL) return -1;
        int err = PyList_Check(blocks) ? PyList_Append(blocks, (PyObject *)b) : 0;
        Py_DECREF(blocks);
        if (err < 0) return -1;
        if (!PyList_Check(blocks)) return 0;  /* (nothing would clear it) */
    }
    MemoEntry *e = &b->memo[b->next];
    b->next = (b->next + 1) % MEMO_WAYS;
    memo_clear_entry(e);
    for (Py_ssize_t i = 0; i < n; i++) e->parts[i] = Py_NewRef(memo_part(PyTuple_GET_ITEM(args, i)));
    e->nargs = n;
    e->run = run;
    e->trace = Py_NewRef(trace);
    return 0;
}

/* memo_entries(block): how many cache hits the block remembers (tests) */
static PyObject *memo_entries(PyObject *mod, PyObject *b) {
    if (!PyObject_TypeCheck(b, &BlockBaseType)) {
        PyErr_SetString(PyExc_TypeError, "memo_entries(block: BlockBase)");
        return NULL;
    }
    long k = 0;
    for (int w = 0; w < MEMO_WAYS; w++) k += ((BlockBaseObject *)b)->memo[w].trace != NULL;
    return PyLong_FromLong(k);
}

/* clear_memos(blocks): drop the remembered hits of these blocks (a map ended) */
static PyObject *clear_memos(PyObject *mod, PyObject *blocks) {
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "clear_memos(blocks: list)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *b = PyList_GET_ITEM(blocks, i);
        if (PyObject_TypeCheck(b, &BlockBaseType)) blockbase_clear((BlockBaseObject *)b);
    }
    Py_RETURN_NONE;
}

/* ``*inputs`` (cached_trace's operands) as a list, in place: 0, or -1 on error */
static int as_list(PyObject **inputs) {
    if (PyList_CheckExact(*inputs)) return 0;
    PyObject *l = PySequence_List(*inputs);
    if (l == NULL) return -1;
    Py_SETREF(*inputs, l);
    return 0;
}

/* The trace a call of ``blk`` with positional ``args`` hits in its cache during map
 * ``rt`` (a new reference; *inputs_out its LazyTensor operands, a new tuple from the
 * block's memo, else a new list: as_list where a list is needed), or NULL:
 * with an exception on error, without one when the call needs the Python path (no
 * per-instance argument, no trace, or one of an earlier map to revalidate). The key is
 * block.Block.trace_for's. */
static PyObject *cached_trace(PyObject *blk, PyObject *args, PyObject *rt,
                              PyObject **inputs_out) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    BlockBaseObject *memo_blk = NULL;
    long long run = -1;
    if (nargs <= MEMO_ARGS && is_block(blk)) {
        PyObject *rid = SLOT_GET(rt, s_id);
        if (rid == NULL) return NULL;
        run = PyLong_AsLongLong(rid);
        Py_DECREF(rid);
        if (run == -1 && PyErr_Occurred()) return NULL;
        memo_blk = (BlockBaseObject *)blk;
        PyObject *hit = memo_lookup(memo_blk, args, run, inputs_out);
        if (hit != NULL || PyErr_Occurred()) return hit;
    }
    PyObject *inputs = PyList_New(0), *key = NULL, *made = NULL, *cache = NULL,
             *trace = NULL, *v = NULL;
    if (inputs == NULL) return NULL;
    key = PyTuple_New(nargs);
    if (key == NULL) goto done;
    made = SLOT_GET(rt, s_factory_keys);
    if (made == NULL) goto done;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *x = PyTuple_GET_ITEM(args, i), *part;
        PyTypeObject *tp = Py_TYPE(x);
        if (tp == lazy_cls) {
            if (PyList_Append(inputs, x) < 0) goto done;
            part = ((LazyObject *)x)->key;
            Py_INCREF(part);
        } else if (tp == &PyTuple_Type || tp == &PyList_Type || tp == &PyDict_Type) {
            PyObject *keep = PyList_New(0);
            if (keep == NULL) goto done;
            part = PyObject_CallFunctionObjArgs(key_fn, x, keep, inputs, NULL);
            Py_DECREF(keep);
            if (part == NULL) goto done;
        } else if (tp == &PyLong_Type || tp == &PyUnicode_Type || x == Py_None) {
            part = x;
            Py_INCREF(part);
        } else if (tp == &PyFloat_Type || tp == &PyBool_Type) {
            part = PyTuple_Pack(2, (PyObject *)tp, x);
            if (part == NULL) goto done;
        } else {  /* by identity, or by how a pure factory made it (see Block.__call__) */
            PyObject *ident = PyLong_FromVoidPtr(x);
            if (ident == NULL) goto done;
            part = PyDict_Check(made) ? PyDict_GetItemWithError(made, ident) : NULL;
            if (part != NULL && PyObject_IsTrue(part) == 1) {
                Py_INCREF(part);
                Py_DECREF(ident);
            } else {
                if (PyErr_Occurred()) {
                    Py_DECREF(ident);
                    goto done;
                }
                part = PyTuple_Pack(2, s_id, ident);
                Py_DECREF(ident);
                if (part == NULL) goto done;
            }
        }
        PyTuple_SET_ITEM(key, i, part);
    }
    if (PyList_GET_SIZE(inputs) == 0) goto take_python;
    cache = PyObject_GetAttr(blk, s_cache);
    if (cache == NULL) goto done;
    if (!PyDict_Check(cache)) goto take_python;
    trace = PyDict_GetItemWithError(cache, key);
    if (trace == NULL) {
        if (PyErr_Occurred()) goto done;
        goto take_python;
    }
    Py_INCREF(trace);
    /* a trace of an earlier map must be revalidated (Python path) */
    v = SLOT_GET(trace, s_run_id);
    if (v == NULL) goto done;
    {
        PyObject *rid = SLOT_GET(rt, s_id);
        if (rid == NULL) goto done;
        int same = PyObject_RichCompareBool(v, rid, Py_EQ);
        Py_DECREF(rid);
        if (same < 0) goto done;
        if (!same) goto take_python;
    }
    if (memo_blk != NULL && memo_store(memo_blk, args, run, trace, rt) < 0) goto done;
    *inputs_out = inputs;
    inputs = NULL;
    goto done;
take_python:
    Py_CLEAR(trace);
done:
    if (PyErr_Occurred()) Py_CLEAR(trace);
    Py_XDECREF(v);
    Py_XDECREF(cache);
    Py_XDECREF(made);
    Py_XDECREF(key);
    Py_XDECREF(inputs);
    return trace;
}

/* trace.call_fast, made and stored on first use: (op, sig, info, kind, may_split), kind
 * 0 for one output returned as it is, 1 for outputs that are a plain tuple of them, 2 for
 * anything block._finish_call packages (Trace drops it when plain_tuple or may_split
 * change). A new reference. */
static PyObject *s_call_fast;

static PyObject *call_fast(PyObject *trace) {
    PyObject *f = SLOT_GET(trace, s_call_fast);
    if (f == NULL || (PyTuple_CheckExact(f) && PyTuple_GET_SIZE(f) == 5)) return f;
    Py_DECREF(f);
    PyObject *op = NULL, *sig = NULL, *info = NULL, *spec = NULL, *v = NULL, *split = NULL;
    f = NULL;
    long kind = 2;
    if ((op = SLOT_GET(trace, s_op)) == NULL) goto done;
    if ((sig = SLOT_GET(trace, s_sig)) == NULL) goto done;
    if ((info = SLOT_GET(trace, s_info)) == NULL) goto done;
    if ((spec = SLOT_GET(trace, s_out_spec)) == NULL) goto done;
    if ((split = SLOT_GET(trace, s_may_split)) == NULL) goto done;
    int may_split = PyObject_IsTrue(split);
    if (may_split < 0) goto done;
    if (PyTuple_Check(spec) && PyTuple_GET_SIZE(spec) >= 1 &&
        PyUnicode_Check(PyTuple_GET_ITEM(spec, 0)) &&
        PyUnicode_Compare(PyTuple_GET_ITEM(spec, 0), s_leaf) == 0) {
        if ((v = SLOT_GET(info, s_single)) == NULL) goto done;
        int one = PyObject_IsTrue(v);
        if (one < 0) goto done;
        if (one) kind = 0;
    }
    if (kind == 2) {
        Py_XSETREF(v, SLOT_GET(trace, s_plain_tuple));
        if (v == NULL) goto done;
        if (v == Py_True) kind = 1;
    }
    f = Py_BuildValue("(OOOlO)", op, sig, info, kind, may_split ? Py_True : Py_False);
    if (f != NULL && SLOT_SET(trace, s_call_fast, f) < 0) Py_CLEAR(f);
done:
    Py_XDECREF(op);
    Py_XDECREF(sig);
    Py_XDECREF(info);
    Py_XDECREF(spec);
    Py_XDECREF(v);
    Py_XDECREF(split);
    return f;
}

/* A call of block ``blk`` with positional ``args`` in map ``rt`` (``fiber``: rt.fiber, or
 * NULL): its node and outputs, or _MISS when it needs the Python path (no per-instance
 * argument, a new or stale trace). The call slots below use it. */
static PyObject *block_call_impl(PyObject *blk, PyObject *args, PyObject *rt,
                                 PyObject *fiber) {
    PyObject *inputs = NULL, *trace = NULL, *out = NULL, *fast = NULL;
    PyObject *node = NULL;
    trace = cached_trace(blk, args, rt, &inputs);
    if (trace == NULL) {
        if (PyErr_Occurred()) return NULL;
        return Py_NewRef(miss);
    }
    fast = call_fast(trace);
    if (fast == NULL) goto done;
    PyObject *top = PyTuple_GET_ITEM(fast, 0), *tsig = PyTuple_GET_ITEM(fast, 1),
             *tinfo = PyTuple_GET_ITEM(fast, 2);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(fast, 3));
    if (PyTuple_GET_ITEM(fast, 4) == Py_True) {
        if (as_list(&inputs) < 0) goto done;
        node = split_hit(rt, trace, inputs, tinfo);
        if (node == NULL) {
            if (PyErr_Occurred()) goto done;
            node = PyObject_CallFunctionObjArgs(split_fn, rt, trace, inputs, NULL);
            if (node == NULL) goto done;
            if (node == Py_None) Py_CLEAR(node);
        }
    }
    if (node == NULL) {
        node = (PyObject *)add_node_impl(rt, top, Py_None, Py_None, Py_None, inputs, tinfo,
                                         tsig, fiber);
        if (node == NULL) goto done;
    }
    /* the common one-output block returns its tensor, a plain tuple its tensors; anything
     * else is packaged by block._finish_call */
    if (kind == 0) {
        out = lazy1(node, tinfo);
        goto done;
    }
    if (kind == 1) {
        out = lazy_all(node, tinfo);
        if (out != NULL || PyErr_Occurred()) goto done;
    }
    if (as_list(&inputs) < 0) goto done;
    out = PyObject_CallFunctionObjArgs(finish_fn, trace, node, inputs, NULL);
done:
    Py_XDECREF(node);
    Py_XDECREF(fast);
    Py_XDECREF(trace);
    Py_XDECREF(inputs);
    return out;
}

/* trace_hit(block, args: tuple, rt): (trace, inputs) when block.Block.trace_for would
 * return that cached trace without tracing (its key built in C), else None. */
static PyObject *trace_hit(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 3 || !PyTuple_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "trace_hit(block, args: tuple, rt)");
        return NULL;
    }
    PyObject *inputs = NULL, *trace = cached_trace(a[0], a[1], a[2], &inputs);
    if (trace == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = as_list(&inputs) < 0 ? NULL : PyTuple_Pack(2, trace, inputs);
    Py_DECREF(trace);
    Py_DECREF(inputs);
    return out;
}

/* ---- call slots: Block, AutoBlock and RegionBlock calls in C -------------------------
 * A Python __call__ is a frame of its own behind slot_tp_call (~0.3 us a call); these
 * bases give the classes a C tp_call that makes the fast path's checks and calls
 * block_call_impl, and calls the class's Python rest (_call, _region_call) otherwise. */

static PyObject *graph_mod;  /* acrobat.graph: RT is the running map's runtime */
static PyObject *s_RT, *s_tracer, *s_thread, *s_disabled, *s_values, *s_block, *s_call;

static PyObject *graph_dict;  /* acrobat.graph's __dict__ */

/* graph.RT, a new reference (a lookup in the module's dict: no getattr) */
static PyObject *graph_rt(void) {
    if (graph_dict != NULL) {
        PyObject *rt = PyDict_GetItemWithError(graph_dict, s_RT);
        if (rt != NULL) return Py_NewRef(rt);
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_GetAttr(graph_mod, s_RT);
}

/* graph.RT (a new reference) when instance code records on it: a map runs, no block is
 * being traced, a fiber runs (and, with check_thread, on the map's thread); *fiber is
 * then the running fiber (a new reference). NULL without an exception when not; NULL
 * with one on error. */
static PyObject *recording_rt(int check_thread, PyObject **fiber) {
    *fiber = NULL;
    if (graph_mod == NULL) return NULL;
    PyObject *rt = graph_rt(), *v, *f = NULL;
    if (rt == NULL) return NULL;
    if (rt == Py_None) goto no;
    v = SLOT_GET(rt, s_tracer);
    if (v == NULL) goto no;
    Py_DECREF(v);
    if (v != Py_None) goto no;
    f = SLOT_GET(rt, s_fiber);
    if (f == NULL || f == Py_None) goto no;
    v = SLOT_GET(f, s_grad);  /* inside a grad-mode region of its own: the Python paths */
    if (v == NULL) goto no;
    Py_DECREF(v);
    if (v != Py_None) goto no;
    if (check_thread) {
        v = SLOT_GET(rt, s_thread);
        if (v == NULL) goto no;
        long long t = slot_value(v);  /* (a thread ident: below 2**60) */
        Py_DECREF(v);
        if (t == -1 && PyErr_Occurred()) goto no;
        if ((unsigned long)t != PyThread_get_thread_ident()) goto no;
    }
    *fiber = f;
    return rt;
no:   /* (and on error, with the exception set) */
    Py_XDECREF(f);
    Py_DECREF(rt);
    return NULL;
}

/* Whether an AutoBlock/RegionBlock dispatcher takes the fast path: 1 when not disabled
 * and without value parameters (AutoBlock._call's other checks), 2 when not disabled
 * with value parameters (a tuple of positions), 0 otherwise; -1 on error. */
static int dispatch_plain(PyObject *self) {
    PyObject *v = SLOT_GET(self, s_disabled);
    if (v == NULL) return -1;
    int off = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (off) return off < 0 ? -1 : 0;
    v = SLOT_GET(self, s_values);
    if (v == NULL) return -1;
    int plain = PyTuple_Check(v) ? (PyTuple_GET_SIZE(v) == 0 ? 1 : 2) : 0;
    Py_DECREF(v);
    return plain;
}

/* self.<name>(*args, **kw): the Python rest of a call slot */
static PyObject *call_method(PyObject *self, PyObject *name, PyObject *args, PyObject *kw) {
    PyObject *meth = PyObject_GetAttr(self, name);
    if (meth == NULL) return NULL;
    PyObject *out = PyObject_Call(meth, args, kw);
    Py_DECREF(meth);
    return out;
}

/* Whether a block call's positional arguments can hold no per-instance tensor: none is a
 * LazyTensor or a container (a tuple, list or dict, or a subclass: a namedtuple State(h,
 * c)) that Block.trace_for would walk. Then trace_for finds no operand and Block._call
 * calls the function as written: block_direct does so without the Python path (a helper
 * called with Python numbers in instance code: ~1.1 -> ~0.1 us a call). */
static int no_lazy_args(PyObject *args) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *x = PyTuple_GET_ITEM(args, i);
        if (Py_TYPE(x) == lazy_cls || PyTuple_Check(x) || PyList_Check(x) || PyDict_Check(x))
            return 0;
    }
    return 1;
}

static PyObject *s_fn;

/* block.fn(*args): Block._call's own call where trace_for finds no operand */
static PyObject *block_direct(PyObject *blk, PyObject *args) {
    PyObject *fn = PyObject_GetAttr(blk, s_fn);
    if (fn == NULL) return NULL;
    PyObject *out = PyObject_Call(fn, args, NULL);
    Py_DECREF(fn);
    return out;
}

/* block.Block.__call__: the trace cache's hit in C, the rest in Block._call */
static PyObject *blockbase_call(PyObject *self, PyObject *args, PyObject *kw) {
    if (miss != NULL && (kw == NULL || PyDict_GET_SIZE(kw) == 0)) {
        PyObject *fiber, *rt = recording_rt(0, &fiber);
        if (rt != NULL && lazy_cls != NULL && no_lazy_args(args)) {
            Py_DECREF(fiber);
            Py_DECREF(rt);
            return block_direct(self, args);
        }
        if (rt != NULL) {
            PyObject *out = block_call_impl(self, args, rt, fiber);
            Py_DECREF(fiber);
            Py_DECREF(rt);
            if (out != miss) return out;  /* the outputs, or NULL on error */
            Py_DECREF(out);
        } else if (PyErr_Occurred()) {
            return NULL;
        }
    }
    return call_method(self, s_call, args, kw);
}

/* analysis.AutoBlock.__call__: an enabled dispatcher without value parameters, called
 * positionally on the map's thread, calls its block's fast path; the rest AutoBlock._call */
static PyObject *value_data_fast(PyObject *rt, PyObject *a);
static PyObject *analysis_mod;
static PyObject *s_value_block, *s_value_call, *s_VALUE_PARAMS, *s_scalar_data;

/* AutoBlock._call's value parameters in C: where config.VALUE_PARAMS is on and every
 * value position holds an int or a float, those become data nodes (ops.scalar_data) and
 * the value block's trace hit records the call; a miss continues in
 * AutoBlock._value_call with the converted arguments. Returns the outputs, NULL on
 * error, or `miss` (a new reference) for the Python path when nothing was recorded. */
static PyObject *autobase_values(PyObject *self, PyObject *values, PyObject *args,
                                 PyObject *rt, PyObject *fiber) {
    Py_ssize_t n = PyTuple_GET_SIZE(args), nv = PyTuple_GET_SIZE(values);
    PyObject *v = PyObject_GetAttr(config_mod, s_VALUE_PARAMS);
    if (v == NULL) return NULL;
    int on = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (on <= 0) return on < 0 ? NULL : Py_NewRef(miss);
    for (Py_ssize_t j = 0; j < nv; j++) {  /* (bools and the rest: the Python path) */
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(values, j));
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0 || i >= n) return Py_NewRef(miss);
        PyTypeObject *tp = Py_TYPE(PyTuple_GET_ITEM(args, i));
        if (tp != &PyLong_Type && tp != &PyFloat_Type) return Py_NewRef(miss);
    }
    PyObject *call_args = PyTuple_New(n), *blk = NULL, *out = NULL;
    if (call_args == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(call_args, i, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    for (Py_ssize_t j = 0; j < nv; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(values, j));
        PyObject *a = PyTuple_GET_ITEM(args, i), *x = value_data_fast(rt, a);
        if (x == NULL) {
            if (PyErr_Occurred()) goto done;
            PyObject *f = PyObject_GetAttr(analysis_mod, s_scalar_data);  /* its own way */
            if (f == NULL) goto done;
            x = PyObject_CallOneArg(f, a);
            Py_DECREF(f);
            if (x == NULL) goto done;
        }
        Py_SETREF(((PyTupleObject *)call_args)->ob_item[i], x);
    }
    blk = SLOT_GET(self, s_value_block);
    if (blk == NULL) goto done;
    out = block_call_impl(blk, call_args, rt, fiber);
    if (out == miss) {  /* trace it (or learn the body needs the numbers) in Python */
        Py_DECREF(out);
        PyObject *pair = PyTuple_Pack(2, args, call_args);
        out = pair == NULL ? NULL : call_method(self, s_value_call, pair, NULL);
        Py_XDECREF(pair);
    }
done:
    Py_XDECREF(blk);
    Py_DECREF(call_args);
    return out;
}

static PyObject *autobase_call(PyObject *self, PyObject *args, PyObject *kw) {
    if (miss != NULL && (kw == NULL || PyDict_GET_SIZE(kw) == 0)) {
        PyObject *fiber, *rt = recording_rt(1, &fiber), *v, *out = NULL;
        if (rt == NULL) {
            if (PyErr_Occurred()) return NULL;
            return call_method(self, s_call, args, kw);
        }
        int plain = dispatch_plain(self);
        if (plain == 2 && config_mod != NULL && analysis_mod != NULL) {
            v = SLOT_GET(self, s_values);
            if (v != NULL) out = autobase_values(self, v, args, rt, fiber);
            Py_XDECREF(v);
            goto done;
        }
        if (plain != 1) goto done;  /* (or an error) */
        v = SLOT_GET(self, s_block);
        if (v == NULL) goto done;
        out = lazy_cls != NULL && no_lazy_args(args) ? block_direct(v, args)
                                                     : block_call_impl(v, args, rt, fiber);
        Py_DECREF(v);
    done:
        Py_DECREF(fiber);
        Py_DECREF(rt);
        if (out == NULL && PyErr_Occurred()) return NULL;
        if (out != NULL && out != miss) return out;
        Py_XDECREF(out);
    }
    return call_method(self, s_call, args, kw);
}

/* analysis.RegionBlock.__call__ (an outlined run's dispatcher): arguments that are lazy
 * tensors, scalars or code-like objects seen before (self.code_like), the values at
 * self.tensor_args made data nodes (ops.value_data, else torch.tensor as written), then
 * the block's fast path; a miss there continues in RegionBlock._region_block with the
 * converted arguments. Anything else, before anything is recorded: _region_call. */
/* analysis_mod (declared above): acrobat.analysis, its value_data and scalar_data read
 * per call */
static PyObject *torch_mod;     /* torch: its tensor, likewise */
static PyObject *s_tensor_args, *s_code_like, *s_hits, *s_region_call, *s_region_block,
    *s_value_data, *s_tensor, *s_index_args, *s_state_args;

/* ops.value_data for the common run arguments, in C: an int (a deferred scalar), a
 * float, a non-empty flat list or tuple of ints or of floats (a mask, a few ids). NULL
 * without an exception for anything else, or before the signature's Info exists: then
 * ops.value_data decides. */
static PyObject *tensor_op, *scalar_size, *int64_dtype, *size_type, *default_dtype_fn;

static PyObject *value_data_fast(PyObject *rt, PyObject *a) {
    PyTypeObject *tp = Py_TYPE(a);
    PyObject *dtype = NULL, *shape = NULL, *data = NULL, *sig = NULL, *out = NULL;
    int deferred = 0;
    if (tensor_op == NULL) return NULL;
    if (tp == &PyLong_Type || tp == &PyFloat_Type) {
        deferred = tp == &PyLong_Type;  /* torch.tensor(word_id): queued if read */
        dtype = deferred ? Py_NewRef(int64_dtype) : PyObject_CallNoArgs(default_dtype_fn);
        shape = Py_NewRef(scalar_size);
        data = Py_NewRef(a);
    } else if (tp == &PyList_Type || tp == &PyTuple_Type) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        if (n == 0) return NULL;
        PyTypeObject *first = Py_TYPE(PySequence_Fast_GET_ITEM(a, 0));
        if (first != &PyLong_Type && first != &PyFloat_Type) return NULL;
        for (Py_ssize_t i = 1; i < n; i++)
            if (Py_TYPE(PySequence_Fast_GET_ITEM(a, i)) != first) return NULL;
        dtype = first == &PyLong_Type ? Py_NewRef(int64_dtype)
                                      : PyObject_CallNoArgs(default_dtype_fn);
        PyObject *dims = Py_BuildValue("(n)", n);
        if (dims == NULL) goto done;
        shape = PyObject_CallOneArg(size_type, dims);
        Py_DECREF(dims);
        data = PySequence_List(a);
    } else {
        return NULL;
    }
    if (dtype == NULL || shape == NULL || data == NULL) goto done;
    sig = PyTuple_Pack(3, tensor_op, shape, dtype);
    if (sig == NULL) goto done;
    out = record_data_impl(rt, tensor_op, sig, data, deferred);
    if (out == Py_None) Py_CLEAR(out);
done:
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(data);
    Py_XDECREF(sig);
    return out;
}

static PyObject *setup_values(PyObject *mod, PyObject *args) {
    PyObject *op, *scalar, *i64, *size, *dflt;
    if (!PyArg_ParseTuple(args, "OOOOO", &op, &scalar, &i64, &size, &dflt)) return NULL;
    Py_INCREF(op); Py_XSETREF(tensor_op, op);
    Py_INCREF(scalar); Py_XSETREF(scalar_size, scalar);
    Py_INCREF(i64); Py_XSETREF(int64_dtype, i64);
    Py_INCREF(size); Py_XSETREF(size_type, size);
    Py_INCREF(dflt); Py_XSETREF(default_dtype_fn, dflt);
    Py_RETURN_NONE;
}

static PyObject *regionbase_call(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *rt = NULL, *fiber = NULL, *targs = NULL, *known = NULL, *newargs = NULL,
             *blk = NULL, *out = NULL, *v = NULL, *iargs = NULL, *sargs = NULL;
    int python = 1;
    if (miss == NULL || analysis_mod == NULL || (kw != NULL && PyDict_GET_SIZE(kw) != 0))
        goto done;
    rt = recording_rt(1, &fiber);
    if (rt == NULL) goto done;
    if (dispatch_plain(self) != 1) goto done;  /* (or an error) */
    targs = SLOT_GET(self, s_tensor_args);
    if (targs == NULL || !PyTuple_Check(targs)) goto done;
    known = SLOT_GET(self, s_code_like);
    if (known == NULL || !PyDict_Check(known)) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(args), nt = PyTuple_GET_SIZE(targs);
    char made[64], index[64];
    if (n > 64) goto done;
    memset(made, 0, (size_t)n);
    memset(index, 0, (size_t)n);
    for (Py_ssize_t j = 0; j < nt; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(targs, j));
        if (i == -1 && PyErr_Occurred()) goto done;
        if (i < 0 || i >= n) goto done;
        made[i] = 1;
    }
    /* parameters read only as an index (analysis._index_only): an int there is made a
     * data node (RegionBlock._indices) once the call is a block call */
    iargs = SLOT_GET(self, s_index_args);
    if (iargs == NULL || !PyTuple_Check(iargs)) goto done;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(iargs); j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(iargs, j));
        if (i == -1 && PyErr_Occurred()) goto done;
        if (i >= 0 && i < n && Py_TYPE(PyTuple_GET_ITEM(args, i)) == &PyLong_Type) index[i] = 1;
    }
    /* a parameter the run writes into (analysis._written) given a real tensor: the Python path
     * reads a shared one as a row (RegionBlock._converted) */
    sargs = SLOT_GET(self, s_state_args);
    if (sargs == NULL || !PyTuple_Check(sargs)) goto done;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(sargs); j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(sargs, j));
        if (i == -1 && PyErr_Occurred()) goto done;
        if (i < 0 || i >= n) continue;
        PyTypeObject *tp = Py_TYPE(PyTuple_GET_ITEM(args, i));
        if (tp != lazy_cls && tp != &PyLong_Type && tp != &PyFloat_Type && tp != &PyBool_Type &&
            PyTuple_GET_ITEM(args, i) != Py_None)
            goto done;
    }
    int lazy = nt > 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (made[i] || index[i]) continue;
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyTypeObject *tp = Py_TYPE(a);
        if (tp == lazy_cls) {
            lazy = 1;
        } else if (!(tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyBool_Type ||
                     tp == &PyUnicode_Type || a == Py_None)) {  /* analysis._REGION_ARGS */
            PyObject *ident = PyLong_FromVoidPtr(a);
            if (ident == NULL) goto done;
            int seen = PyDict_Contains(known, ident);
            Py_DECREF(ident);
            if (seen <= 0) goto done;  /* (or an error) the Python path looks at it */
        }
    }
    if (!lazy) goto done;
    python = 0;  /* from here on, nodes are recorded: no going back to _region_call */
    newargs = PyTuple_New(n);
    if (newargs == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i), *x;
        if (index[i]) {  /* as RegionBlock._indices: scalar_data(a), deferred */
            x = value_data_fast(rt, a);
            if (x == NULL && PyErr_Occurred()) goto done;
            if (x == NULL) {
                PyObject *f = PyObject_GetAttr(analysis_mod, s_scalar_data);
                if (f == NULL) goto done;
                x = PyObject_CallOneArg(f, a);
                Py_DECREF(f);
                if (x == NULL) goto done;
            }
            PyTuple_SET_ITEM(newargs, i, x);
            continue;
        }
        if (made[i]) {  /* as RegionBlock._tensors: value_data(a), else torch.tensor(a) */
            x = value_data_fast(rt, a);
            if (x == NULL && PyErr_Occurred()) goto done;
            if (x != NULL) {
                PyTuple_SET_ITEM(newargs, i, x);
                continue;
            }
            PyObject *f = PyObject_GetAttr(analysis_mod, s_value_data);
            if (f == NULL) goto done;
            x = PyObject_CallOneArg(f, a);
            Py_DECREF(f);
            if (x == NULL) goto done;
            if (x == Py_None) {
                Py_DECREF(x);
                f = PyObject_GetAttr(torch_mod, s_tensor);
                if (f == NULL) goto done;
                x = PyObject_CallOneArg(f, a);
                Py_DECREF(f);
                if (x == NULL) goto done;
            }
        } else {
            x = a;
            Py_INCREF(x);
        }
        PyTuple_SET_ITEM(newargs, i, x);
    }
    v = SLOT_GET(self, s_hits);
    if (v == NULL) goto done;
    {
        PyObject *more = PyNumber_Add(v, one);
        if (more == NULL) goto done;
        int bad = PyObject_SetAttr(self, s_hits, more);
        Py_DECREF(more);
        if (bad < 0) goto done;
    }
    blk = SLOT_GET(self, s_block);
    if (blk == NULL) goto done;
    out = block_call_impl(blk, newargs, rt, fiber);
    if (out == miss) {
        Py_CLEAR(out);
        out = call_method(self, s_region_block, newargs, NULL);
    }
done:
    Py_XDECREF(fiber);
    Py_XDECREF(rt);
    Py_XDECREF(targs);
    Py_XDECREF(iargs);
    Py_XDECREF(sargs);
    Py_XDECREF(known);
    Py_XDECREF(newargs);
    Py_XDECREF(blk);
    Py_XDECREF(v);
    if (out != NULL || PyErr_Occurred()) return out;
    if (!python) return NULL;  /* an error is set on every such path */
    return call_method(self, s_region_call, args, kw);
}

/* analysis.ScanBlock.__call__ (an outlined loop's dispatcher), its common case in C:
 * not disabled, loops over sequences of lazy tensors (no counted loop, no number
 * sequences), every sequence a list or tuple of lazy tensors of one key and all of one
 * length (at least two steps), the free arguments lazy tensors, scalars or code-like
 * objects seen before, the carried states lazy tensors or shared constants made by a
 * pure factory (executor.constant), the body's trace cached for this map with its Scan,
 * and the block not retracing: then Scan.record. Anything else, before anything is
 * recorded: ScanBlock._scan_call, the whole dispatcher in Python. */
static PyObject *executor_mod;  /* acrobat.executor: its constant (config_mod: above) */
static PyObject *deferred_kw;   /* ("deferred",): scalar_data's keyword */
static PyObject *s_counted, *s_sequences, *s_carried, *s_reverse, *s_step, *s_scan,
    *s_record, *s_scan_call, *s_run_traces, *s_AUTO_SCANS, *s_CONSTANT_STATES,
    *s_BLOCK_CACHE_SIZE, *s_constant;

static int config_flag(PyObject *name) {  /* bool(config.<name>): 1, 0, or -1 */
    PyObject *v = PyObject_GetAttr(config_mod, name);
    if (v == NULL) return -1;
    int on = PyObject_IsTrue(v);
    Py_DECREF(v);
    return on;
}

static PyObject *scanbase_call(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *rt = NULL, *fiber = NULL, *v = NULL, *seqs = NULL, *known = NULL,
             *made = NULL, *first = NULL, *step = NULL, *blk = NULL, *trace = NULL,
             *inputs = NULL, *scan = NULL, *out = NULL, *cnt = NULL, *numbers = NULL;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (miss == NULL || config_mod == NULL || executor_mod == NULL || analysis_mod == NULL ||
        nargs < 2 || (kw != NULL && PyDict_GET_SIZE(kw) != 0))
        goto python;
    rt = recording_rt(1, &fiber);
    if (rt == NULL) goto python;  /* (an error included: the Python path meets it too) */
    int plain = dispatch_plain(self);  /* 1: no number sequences, 2: some */
    if (plain < 1) goto python;  /* disabled (or an error) */
    if (config_flag(s_AUTO_SCANS) != 1) goto python;
    Py_ssize_t nnum = 0;
    if (plain == 2) {  /* positions of sequences of Python numbers */
        numbers = SLOT_GET(self, s_values);
        if (numbers == NULL || !PyTuple_Check(numbers)) goto python;
        nnum = PyTuple_GET_SIZE(numbers);
    }
    char is_number[16];
    memset(is_number, 0, sizeof is_number);
    v = SLOT_GET(self, s_counted);
    if (v == NULL) goto python;
    int counted = PyObject_IsTrue(v);
    Py_CLEAR(v);
    if (counted < 0) goto python;
    PyObject *items = PyTuple_GET_ITEM(args, 0), *lists = PyTuple_GET_ITEM(args, 1);
    Py_ssize_t S = 0, count = -1;
    if (counted) {  /* for _ in range(n): no sequences, n steps */
        if (Py_TYPE(items) != &PyRange_Type || nnum != 0) goto python;
        count = PyObject_Length(items);
        seqs = PyList_New(0);
        if (count < 2 || seqs == NULL) goto python;  /* (or an error) */
    } else {
        v = SLOT_GET(self, s_sequences);
        if (v == NULL) goto python;
        S = PyLong_AsSsize_t(v);
        Py_CLEAR(v);
        if (S < 1 || S > (Py_ssize_t)sizeof is_number) goto python;  /* (or an error) */
        for (Py_ssize_t j = 0; j < nnum; j++) {
            Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(numbers, j));
            if (at < 0 || at >= S) goto python;  /* (or an error) */
            is_number[at] = 1;
        }
        seqs = PyList_New(S);
        if (seqs == NULL) goto python;
        if (S == 1) {
            PyList_SET_ITEM(seqs, 0, Py_NewRef(items));
        } else {
            if (!(PyTuple_CheckExact(items) || PyList_CheckExact(items))) goto python;
            if (PySequence_Fast_GET_SIZE(items) != S) goto python;
            for (Py_ssize_t j = 0; j < S; j++)
                PyList_SET_ITEM(seqs, j, Py_NewRef(PySequence_Fast_GET_ITEM(items, j)));
        }
        for (Py_ssize_t j = 0; j < S; j++) {
            PyObject *seq = PyList_GET_ITEM(seqs, j);
            if (!(PyList_CheckExact(seq) || PyTuple_CheckExact(seq))) goto python;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
            if (n < 2 || (count >= 0 && n != count)) goto python;
            count = n;
            PyObject **xs = PySequence_Fast_ITEMS(seq);
            PyTypeObject *kind = Py_TYPE(xs[0]);
            if (is_number[j]) {  /* numbers of one type the body reads as torch.tensor(x) */
                if (kind != &PyLong_Type && kind != &PyFloat_Type && kind != &PyBool_Type)
                    goto python;  /* (ops.SCALAR_DTYPES) */
                for (Py_ssize_t i = 1; i < n; i++)
                    if (Py_TYPE(xs[i]) != kind) goto python;
                continue;
            }
            if (kind != lazy_cls) goto python;
            PyObject *key = ((LazyObject *)xs[0])->key;
            for (Py_ssize_t i = 1; i < n; i++) {  /* lazy tensors of one key */
                if (Py_TYPE(xs[i]) != lazy_cls) goto python;
                PyObject *other = ((LazyObject *)xs[i])->key;
                if (other != key && PyObject_RichCompareBool(other, key, Py_EQ) != 1)
                    goto python;  /* (or an error) */
            }
        }
        v = SLOT_GET(self, s_reverse);
        if (v == NULL) goto python;
        int reverse = PyObject_IsTrue(v);
        Py_CLEAR(v);
        if (reverse < 0) goto python;
        if (reverse) {  /* the loop runs over reversed(items): its one sequence, reversed */
            if (S != 1) goto python;
            PyObject *rev = PySequence_List(PyList_GET_ITEM(seqs, 0));
            if (rev == NULL || PyList_Reverse(rev) < 0) {
                Py_XDECREF(rev);
                goto python;
            }
            PyList_SetItem(seqs, 0, rev);  /* (steals rev) */
        }
    }
    v = SLOT_GET(self, s_carried);
    if (v == NULL) goto python;
    Py_ssize_t k = PyLong_AsSsize_t(v);
    Py_CLEAR(v);
    Py_ssize_t nvals = nargs - 2;
    if (k < 0 || k > nvals) goto python;
    step = SLOT_GET(self, s_step);
    if (step == NULL) goto python;
    known = SLOT_GET(step, s_code_like);
    if (known == NULL || !PyDict_Check(known)) goto python;
    for (Py_ssize_t i = 2 + k; i < nargs; i++) {  /* the free arguments */
        PyObject *a = PyTuple_GET_ITEM(args, i);
        PyTypeObject *tp = Py_TYPE(a);
        if (tp == lazy_cls || tp == &PyLong_Type || tp == &PyFloat_Type ||
            tp == &PyBool_Type || tp == &PyUnicode_Type || a == Py_None)
            continue;  /* (analysis._REGION_ARGS) */
        PyObject *ident = PyLong_FromVoidPtr(a);
        if (ident == NULL) goto python;
        int seen = PyDict_Contains(known, ident);
        Py_DECREF(ident);
        if (seen != 1) goto python;  /* (or an error) the Python path looks at it */
    }
    first = PyTuple_New(S + nvals);
    if (first == NULL) goto python;
    for (Py_ssize_t j = 0; j < S; j++) {
        PyObject *head = PySequence_Fast_GET_ITEM(PyList_GET_ITEM(seqs, j), 0);
        if (is_number[j]) {  /* the tensor the body gets: scalar_data(x, deferred=True) */
            PyObject *f = PyObject_GetAttr(analysis_mod, s_scalar_data);
            if (f == NULL) goto python;
            PyObject *call_args[2] = {head, Py_True};
            head = PyObject_Vectorcall(f, call_args, 1, deferred_kw);
            Py_DECREF(f);
            if (head == NULL) goto python;
        } else {
            Py_INCREF(head);
        }
        PyTuple_SET_ITEM(first, j, head);
    }
    for (Py_ssize_t i = 0; i < nvals; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, 2 + i);
        if (i < k && Py_TYPE(a) != lazy_cls) {  /* a carried state that is not lazy */
            if (made == NULL) {
                if (config_flag(s_CONSTANT_STATES) != 1) goto python;
                made = SLOT_GET(rt, s_factory_keys);
                if (made == NULL || !PyDict_Check(made)) goto python;
            }
            PyObject *ident = PyLong_FromVoidPtr(a);
            if (ident == NULL) goto python;
            int shared = PyDict_Contains(made, ident);
            Py_DECREF(ident);
            if (shared != 1) goto python;  /* another real tensor: the peeled first step */
            PyObject *f = PyObject_GetAttr(executor_mod, s_constant);
            if (f == NULL) goto python;
            a = PyObject_CallFunctionObjArgs(f, rt, a, NULL);  /* read as a row */
            Py_DECREF(f);
            if (a == NULL) goto python;
            if (Py_TYPE(a) != lazy_cls) {
                Py_DECREF(a);
                goto python;
            }
        } else {
            Py_INCREF(a);
        }
        PyTuple_SET_ITEM(first, S + i, a);
    }
    blk = SLOT_GET(step, s_block);
    if (blk == NULL) goto python;
    trace = cached_trace(blk, first, rt, &inputs);
    if (trace == NULL) goto python;  /* not traced in this map yet: the Python path */
    v = SLOT_GET(blk, s_run_traces);
    if (v == NULL) goto python;
    long long runs = PyLong_AsLongLong(v);
    Py_CLEAR(v);
    if (runs == -1 && PyErr_Occurred()) goto python;
    v = PyObject_GetAttr(config_mod, s_BLOCK_CACHE_SIZE);
    if (v == NULL) goto python;
    long long cap = PyLong_AsLongLong(v);
    Py_CLEAR(v);
    if ((cap == -1 && PyErr_Occurred()) || runs > cap / 4) goto python;  /* (_retraces) */
    scan = SLOT_GET(trace, s_scan);
    if (scan == NULL || scan == Py_None || scan == Py_False) goto python;
    cnt = PyLong_FromSsize_t(count);
    if (cnt == NULL) goto python;
    if (as_list(&inputs) < 0) goto done;
    out = PyObject_CallMethodObjArgs(scan, s_record, rt, inputs, seqs, cnt, lists, NULL);
    goto done;  /* (recorded, or an error from recording: not the Python path) */
python:
    if (PyErr_Occurred()) PyErr_Clear();
    out = call_method(self, s_scan_call, args, kw);
done:
    Py_XDECREF(rt);
    Py_XDECREF(fiber);
    Py_XDECREF(v);
    Py_XDECREF(seqs);
    Py_XDECREF(known);
    Py_XDECREF(made);
    Py_XDECREF(first);
    Py_XDECREF(step);
    Py_XDECREF(blk);
    Py_XDECREF(trace);
    Py_XDECREF(inputs);
    Py_XDECREF(scan);
    Py_XDECREF(cnt);
    Py_XDECREF(numbers);
    return out;
}

static PyObject *setup_scans(PyObject *mod, PyObject *args) {
    PyObject *c, *e;
    if (!PyArg_ParseTuple(args, "OO", &c, &e)) return NULL;
    if (deferred_kw == NULL && (deferred_kw = Py_BuildValue("(s)", "deferred")) == NULL)
        return NULL;
    Py_INCREF(c); Py_XSETREF(config_mod, c);
    Py_INCREF(e); Py_XSETREF(executor_mod, e);
    Py_RETURN_NONE;
}

/* a call slot's type: no fields of its own (the Python subclass keeps its __dict__) */
#define CALL_SLOT_TYPE(var, name, doc, call)                                        \
    static PyTypeObject var = {                                                     \
        PyVarObject_HEAD_INIT(NULL, 0)                                              \
        .tp_name = "acrobat._native." name,                                         \
        .tp_basicsize = sizeof(PyObject),                                           \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,                       \
        .tp_doc = doc,                                                              \
        .tp_call = call,                                                            \
        .tp_new = PyType_GenericNew,                                                \
    };

CALL_SLOT_TYPE(RegionBaseType, "RegionBase",
               "analysis.RegionBlock's call in C (see RegionBlock._region_call)",
               regionbase_call)
CALL_SLOT_TYPE(AutoBaseType, "AutoBase", "analysis.AutoBlock's call in C (see AutoBlock._call)",
               autobase_call)
CALL_SLOT_TYPE(ScanBaseType, "ScanBase",
               "analysis.ScanBlock's call in C (see ScanBlock._scan_call)", scanbase_call)
#undef CALL_SLOT_TYPE

static PyTypeObject BlockBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "acrobat._native.BlockBase",
    .tp_basicsize = sizeof(BlockBaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "block.Block's call in C (see Block._call) and its last cache hits",
    .tp_traverse = (traverseproc)blockbase_traverse,
    .tp_clear = (inquiry)blockbase_clear,
    .tp_dealloc = (destructor)blockbase_dealloc,
    .tp_call = blockbase_call,
    .tp_new = PyType_GenericNew,
};

static PyObject *setup_calls(PyObject *mod, PyObject *args) {
    PyObject *g, *an, *tm;
    if (!PyArg_ParseTuple(args, "OOO", &g, &an, &tm)) return NULL;
    Py_INCREF(g); Py_XSETREF(graph_mod, g);
    PyObject *gd = PyModule_Check(g) ? PyModule_GetDict(g) : NULL;  /* borrowed */
    Py_XINCREF(gd); Py_XSETREF(graph_dict, gd);
    Py_INCREF(an); Py_XSETREF(analysis_mod, an);
    Py_INCREF(tm); Py_XSETREF(torch_mod, tm);
    Py_RETURN_NONE;
}

static PyObject *setup_record(PyObject *mod, PyObject *args) {
    PyObject *f, *fk, *inf, *wo, *cl;
    if (!PyArg_ParseTuple(args, "OOOOO", &f, &fk, &inf, &wo, &cl)) return NULL;
    Py_INCREF(cl); Py_XSETREF(copy_lists_fn, cl);
    Py_INCREF(f); Py_XSETREF(freeze_fn, f);
    Py_INCREF(fk); Py_XSETREF(freeze_kwargs_fn, fk);
    Py_INCREF(inf); Py_XSETREF(infer_fn, inf);
    Py_INCREF(wo); Py_XSETREF(wrap_outputs_fn, wo);
    Py_RETURN_NONE;
}

static PyObject *setup_block(PyObject *mod, PyObject *args) {
    PyObject *k, *fin, *sp, *m;
    if (!PyArg_ParseTuple(args, "OOOO", &k, &fin, &sp, &m)) return NULL;
    Py_INCREF(k); Py_XSETREF(key_fn, k);
    Py_INCREF(fin); Py_XSETREF(finish_fn, fin);
    Py_INCREF(sp); Py_XSETREF(split_fn, sp);
    Py_INCREF(m); Py_XSETREF(miss, m);
    Py_RETURN_NONE;
}

/* ---- value reads: fibers.demand_py's common path ---------------------------------
 * A read of a value computed by a flush of this map, whose batch fibers.demand_py has
 * converted to Python rows already (every read after the first of a batch), or a read
 * of a pending value: the fiber suspends (joins rt.blocked and switches to the driver),
 * then reads its row. Anything else (errors, a first read of a batch, a block being
 * traced, a deferred constant, a value copied to the host) is demand_py itself. */

static PyObject *demand_py_fn;  /* fibers.demand_py */
static PyObject *tf_enabled_fn; /* torch._C._is_torch_function_enabled */
static PyObject *host_list_fn;  /* fibers._host_list */
static PyObject *s_blocked, *s_waiting, *s_host, *s_switch, *s_py_rows, *s_ready, *s_failed,
    *s_glet, *s_popleft, *s_pool, *s_main, *s_parent;

typedef PyObject *(*greenlet_switch_fn)(PyObject *g, PyObject *args, PyObject *kwargs);
static greenlet_switch_fn gl_switch;  /* greenlet's C API: see import_greenlet_api */
static PyTypeObject *gl_type;
static void import_greenlet_api(void);

static PyObject *setup_fibers(PyObject *mod, PyObject *args) {
    PyObject *d, *h, *e;
    if (!PyArg_ParseTuple(args, "OOO", &d, &h, &e)) return NULL;
    Py_INCREF(d); Py_XSETREF(demand_py_fn, d);
    Py_INCREF(h); Py_XSETREF(host_list_fn, h);
    Py_INCREF(e); Py_XSETREF(tf_enabled_fn, e);
    if (gl_switch == NULL) import_greenlet_api();
    Py_RETURN_NONE;
}

/* greenlet's C API (the capsule greenlet._C_API, its documented slots: 0 the greenlet
 * type, 6 PyGreenlet_Switch(g, args, kwargs)), imported by setup_fibers; without it
 * (NULL) g.switch is called as a method. The API's switch is the method's own code,
 * without the method lookup and the argument tuple: ~40 ns of a switch's ~250, at
 * DRNN's ~2,600 switches a map at b64. */

static void import_greenlet_api(void) {
    void **api = (void **)PyCapsule_Import("greenlet._C_API", 0);
    if (api == NULL) {  /* (an old or odd greenlet: the method works as well) */
        PyErr_Clear();
        return;
    }
    gl_type = (PyTypeObject *)api[0];
    gl_switch = (greenlet_switch_fn)api[6];
}

/* g.switch(*args) for 0 or 1 argument; the value switched back with (a new reference) */
static PyObject *switch_to(PyObject *g, PyObject *arg) {
    if (gl_switch != NULL && PyObject_TypeCheck(g, gl_type)) {
        if (arg == NULL) return gl_switch(g, NULL, NULL);
        PyObject *args = PyTuple_Pack(1, arg);
        if (args == NULL) return NULL;
        PyObject *r = gl_switch(g, args, NULL);
        Py_DECREF(args);
        return r;
    }
    PyObject *callargs[3] = {NULL, g, arg};
    return PyObject_VectorcallMethod(s_switch, callargs + 1,
                                     (arg == NULL ? 1 : 2) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* fibers.switch_away(rt): the running fiber blocks (a value demand or a join); switch
 * straight to the next ready fiber: one that has started (it is suspended) on its own
 * greenlet, one that has not on the last parked worker of rt.pool. To the driver
 * (rt.main) when none is ready, a fiber failed, or a fiber must start and no worker is
 * parked (only the driver creates workers: a greenlet made here would have its C stack
 * below this fiber's, and nested ones would deepen it without bound). */
static int switch_away(PyObject *rt) {
    PyObject *ready = SLOT_GET(rt, s_ready), *failed = NULL, *head = NULL;
    PyObject *g = NULL, *res = NULL, *pool = NULL, *main = NULL, *parent = NULL;
    int r = -1;
    if (ready == NULL) return -1;
    Py_ssize_t n = PyObject_Length(ready);
    if (n < 0) goto done;
    if (n > 0) {
        if ((failed = SLOT_GET(rt, s_failed)) == NULL) goto done;
        if (failed == Py_None) {
            if ((head = PySequence_GetItem(ready, 0)) == NULL) goto done;
            if ((g = SLOT_GET(head, s_glet)) == NULL) goto done;
        }
    }
    if (g == Py_None) {  /* not started: on a parked worker, if one is */
        Py_CLEAR(g);
        if ((pool = SLOT_GET(rt, s_pool)) == NULL) goto done;
        if (!PyList_Check(pool)) {
            PyErr_SetString(PyExc_TypeError, "switch_away: rt.pool must be a list");
            goto done;
        }
        Py_ssize_t parked = PyList_GET_SIZE(pool);
        if (parked > 0) {
            g = Py_NewRef(PyList_GET_ITEM(pool, parked - 1));
            if (PyList_SetSlice(pool, parked - 1, parked, NULL) < 0) goto done;
        }
    }
    if ((main = SLOT_GET(rt, s_main)) == NULL) goto done;
    if (g == NULL) {  /* none ready, a failed fiber, or no worker parked */
        res = switch_to(main, NULL);
        goto done;
    }
    PyObject *callargs[2] = {NULL, ready};
    PyObject *popped = PyObject_VectorcallMethod(
        s_popleft, callargs + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (popped == NULL) goto done;
    Py_DECREF(popped);  /* (head: the deque holds no other reference now) */
    if (pool != NULL) {  /* a parked worker: under the driver, given the fiber to run */
        if ((parent = PyObject_GetAttr(g, s_parent)) == NULL) goto done;
        if (parent != main && PyObject_SetAttr(g, s_parent, main) < 0) goto done;
        if (SLOT_SET(head, s_glet, g) < 0) goto done;
        if (SLOT_SET(rt, s_fiber, head) < 0) goto done;
        res = switch_to(g, head);
    } else {
        if (SLOT_SET(rt, s_fiber, head) < 0) goto done;
        res = switch_to(g, NULL);
    }
done:
    if (res != NULL) {  /* resumed */
        Py_DECREF(res);
        r = 0;
        PyObject *hook = SLOT_GET(rt, s_grad_resume);  /* the thread's grad mode back to */
        if (hook == NULL) {                             /* this fiber's, while any fiber */
            r = -1;                                     /* has a grad-mode region */
        } else {
            if (hook != Py_None) {
                PyObject *done_ = PyObject_CallNoArgs(hook);
                if (done_ == NULL) r = -1;
                Py_XDECREF(done_);
            }
            Py_DECREF(hook);
        }
    }  /* (NULL: thrown into the fiber, map cleanup: unwinds) */
    Py_XDECREF(parent);
    Py_XDECREF(main);
    Py_XDECREF(pool);
    Py_XDECREF(g);
    Py_XDECREF(head);
    Py_XDECREF(failed);
    Py_DECREF(ready);
    return r;
}

/* switch_away(rt), for the joins of fibers.py */
static PyObject *py_switch_away(PyObject *mod, PyObject *rt) {
    if (switch_away(rt) < 0) return NULL;
    Py_RETURN_NONE;
}

/* suspend ``fiber``, the running fiber of ``rt``, until a flush computes ``t``; 1 when
 * it resumed with a host copy in *host (a new reference), 0 without, -1 on error */
static int suspend(PyObject *rt, PyObject *fiber, PyObject *t, PyObject **host) {
    PyObject *blocked = NULL;
    int r = -1;
    *host = NULL;
    blocked = SLOT_GET(rt, s_blocked);
    if (blocked == NULL) goto done;
    if (SLOT_SET(fiber, s_waiting, t) < 0 || PyList_Append(blocked, fiber) < 0)
        goto done;
    Py_CLEAR(blocked);
    if (switch_away(rt) < 0) goto done;
    if (SLOT_SET(fiber, s_waiting, Py_None) < 0) goto done;
    PyObject *h = SLOT_GET(fiber, s_host);
    if (h == NULL) goto done;
    if (h == Py_None) {
        Py_DECREF(h);
        r = 0;
    } else if (SLOT_SET(fiber, s_host, Py_None) < 0) {
        Py_DECREF(h);
    } else {
        *host = h;
        r = 1;
    }
done:
    Py_XDECREF(blocked);
    return r;
}

/* the row of t's batch in rt.py_rows, copied as demand_py's _copy does (a new
 * reference); NULL without an exception when demand_py must make it */
static PyObject *py_row(PyObject *rt, NodeObject *nd, LazyObject *t) {
    if (!PyTuple_Check(nd->outs) || !PyLong_Check(t->idx)) return NULL;
    Py_ssize_t idx = PyLong_AsSsize_t(t->idx);
    if (idx < 0 || idx >= PyTuple_GET_SIZE(nd->outs)) return NULL;
    PyObject *rows_by_id = SLOT_GET(rt, s_py_rows);
    if (rows_by_id == NULL) return NULL;
    PyObject *rows = NULL, *key = PyLong_FromVoidPtr(PyTuple_GET_ITEM(nd->outs, idx));
    if (key != NULL && PyDict_CheckExact(rows_by_id))
        rows = PyDict_GetItemWithError(rows_by_id, key);  /* borrowed */
    Py_XDECREF(key);
    Py_DECREF(rows_by_id);  /* (rt holds it) */
    if (rows == NULL || !PyList_CheckExact(rows) || nd->row < 0 ||
        nd->row >= PyList_GET_SIZE(rows))
        return NULL;
    PyObject *row = PyList_GET_ITEM(rows, nd->row);
    if (row == Py_None) return NULL;  /* handed out already: demand_py converts anew */
    if (!PyList_CheckExact(row)) return Py_NewRef(row);
    Py_ssize_t k = PyList_GET_SIZE(row);
    if (k && PyList_CheckExact(PyList_GET_ITEM(row, 0))) return NULL;  /* nested: _copy */
    /* The caller may mutate its list: the row's first read takes the converted list
     * itself (a node's row is its own instance's, read once: DRNN's 1,574 decisions a
     * map at b64), leaving None, so a later read of the row (the same value read twice,
     * or a row two instances share, executor._distinct) converts the tensor again. */
    Py_INCREF(Py_None);
    PyList_SET_ITEM(rows, nd->row, Py_None);
    return row;  /* (the list's reference, now the caller's) */
}

static PyObject *value_read(PyObject *mod, PyObject *arg) {
    if (demand_py_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_fibers was not called");
        return NULL;
    }
    if (graph_mod == NULL || !IS_LAZY(arg)) goto slow;
    LazyObject *t = (LazyObject *)arg;
    if (t->node == NULL || !IS_NODE(t->node)) goto slow;
    NodeObject *nd = (NodeObject *)t->node;
    PyObject *rt = graph_rt(), *out = NULL;
    if (rt == NULL) return NULL;
    if (rt == Py_None || nd->rt != rt) goto slow_rt;
    if (nd->outs == NULL || nd->outs == Py_None) {
        if (nd->depth < 0) goto slow_rt;  /* a deferred constant: demand_py queues it */
        PyObject *v = SLOT_GET(rt, s_tracer);
        if (v == NULL) goto fail;
        Py_DECREF(v);
        if (v != Py_None) goto slow_rt;  /* a block reads a value: demand_py's error */
        if (tf_enabled_fn != NULL) {  /* inside acrobat's or torch's own evaluation: */
            PyObject *on = PyObject_CallNoArgs(tf_enabled_fn);  /* demand_py's error */
            if (on == NULL) goto fail;
            Py_DECREF(on);
            if (on != Py_True) goto slow_rt;
        }
        PyObject *fiber = SLOT_GET(rt, s_fiber), *host;
        if (fiber == NULL) goto fail;
        if (fiber == Py_None) {
            Py_DECREF(fiber);
            goto slow_rt;
        }
        nd->demanded = 1;  /* (its bucket runs at the flush: scheduler.unneeded) */
        int r = suspend(rt, fiber, arg, &host);
        Py_DECREF(fiber);
        if (r < 0) goto fail;
        if (r == 1) {
            out = PyObject_CallOneArg(host_list_fn, host);
            Py_DECREF(host);
            Py_DECREF(rt);
            return out;
        }
        if (nd->outs == NULL || nd->outs == Py_None) goto slow_rt;  /* (demand_py says) */
    }
    out = py_row(rt, nd, t);
    if (out != NULL || PyErr_Occurred()) {
        Py_DECREF(rt);
        return out;
    }
slow_rt:
    Py_DECREF(rt);
slow:
    return PyObject_CallOneArg(demand_py_fn, arg);
fail:
    Py_DECREF(rt);
    return NULL;
}

/* ---- fibers._fiber_main ----------------------------------------------------------
 * A fiber's run on its worker greenlet: its task called, its value or error kept, its
 * joiners made ready. The wrapping of an instance's inputs and the end of a grad-mode
 * region the fiber left open stay in Python (fibers._wrap_args, fibers._end_grad). */

static PyObject *wrap_args_fn, *end_grad_fn;
static PyObject *s_task, *s_value, *s_error, *s_done, *s_joiners, *s_extend;

static PyObject *setup_fiber_main(PyObject *mod, PyObject *args) {
    PyObject *w, *g;
    if (!PyArg_ParseTuple(args, "OO", &w, &g)) return NULL;
    Py_INCREF(w); Py_XSETREF(wrap_args_fn, w);
    Py_INCREF(g); Py_XSETREF(end_grad_fn, g);
    Py_RETURN_NONE;
}

/* resume_all(blocked, ready): the driver's end of a flush (fibers._drive): every fiber
 * of ``blocked`` whose demanded value (fiber.waiting, a LazyTensor) the flush computed
 * appended to the deque ``ready``, in order. Returns None, or the first fiber whose
 * value is still missing (a scheduler bug: the driver raises), appending none then.
 * ~10 ns a fiber against ~90 in the Python loop (DRNN: 1,574 a map at b64). */
static PyObject *resume_all(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyList_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "resume_all(blocked: list, ready: deque)");
        return NULL;
    }
    PyObject *blocked = a[0];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocked); i++) {
        PyObject *fb = PyList_GET_ITEM(blocked, i);
        PyObject *t = SLOT_GET(fb, s_waiting);
        if (t == NULL) return NULL;
        int missing = !IS_LAZY(t) || ((LazyObject *)t)->node == NULL ||
                      !IS_NODE(((LazyObject *)t)->node);
        if (!missing) {
            NodeObject *nd = (NodeObject *)((LazyObject *)t)->node;
            missing = nd->outs == NULL || nd->outs == Py_None;
        }
        Py_DECREF(t);
        if (missing) return Py_NewRef(fb);
    }
    PyObject *callargs[3] = {NULL, a[1], blocked};
    PyObject *r = PyObject_VectorcallMethod(s_extend, callargs + 1,
                                            2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *fiber_main(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "fiber_main(rt, fiber)");
        return NULL;
    }
    if (wrap_args_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_fiber_main was not called");
        return NULL;
    }
    PyObject *rt = a[0], *fiber = a[1], *task, *hook, *args = NULL, *value, *v;
    if ((task = SLOT_GET(fiber, s_task)) == NULL) return NULL;
    if (!PyTuple_CheckExact(task) || PyTuple_GET_SIZE(task) != 4) {
        Py_DECREF(task);
        PyErr_SetString(PyExc_TypeError, "fiber_main: a fiber's task is (fn, args, kwargs, wrap)");
        return NULL;
    }
    if (SLOT_SET(fiber, s_task, Py_None) < 0) goto fail;
    if ((hook = SLOT_GET(rt, s_grad_resume)) == NULL) goto fail;
    if (hook != Py_None) {  /* (the thread's grad mode may be another fiber's) */
        PyObject *r = PyObject_CallNoArgs(hook);
        Py_DECREF(hook);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    } else {
        Py_DECREF(hook);
    }
    /* fn(*args, **kwargs), the wrapping of an instance's inputs included: a failure of
     * either is the fiber's error */
    PyObject *fn = PyTuple_GET_ITEM(task, 0), *kwargs = PyTuple_GET_ITEM(task, 2);
    args = Py_NewRef(PyTuple_GET_ITEM(task, 1));
    int wrap = PyObject_IsTrue(PyTuple_GET_ITEM(task, 3));
    if (wrap > 0) Py_SETREF(args, PyObject_CallOneArg(wrap_args_fn, args));
    value = NULL;
    if (wrap < 0 || args == NULL) {
        /* (the error is set) */
    } else if (!PyTuple_Check(args) || !PyDict_Check(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "fiber_main: a task's arguments are a tuple and a dict");
    } else {
        value = PyObject_Call(fn, args, PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    }
    if (value != NULL) {  /* fiber.value = fn(*args, **kwargs) */
        int err = SLOT_SET(fiber, s_value, value);
        Py_DECREF(value);
        if (err < 0) goto fail;
    } else {  /* any BaseException: re-raised by the driver, with the instance named */
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        if (exc == NULL) {  /* (cannot be: an error without a value) */
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyErr_SetString(PyExc_SystemError, "fiber_main: a failure without an exception");
            goto fail;
        }
        if (tb != NULL) PyException_SetTraceback(exc, tb);
        int err = SLOT_SET(fiber, s_error, exc);
        Py_XDECREF(type);
        Py_DECREF(exc);
        Py_XDECREF(tb);
        if (err < 0) goto fail;
    }
    if (SLOT_SET(fiber, s_done, Py_True) < 0) goto fail;
    if ((v = SLOT_GET(fiber, s_grad)) == NULL) goto fail;
    Py_DECREF(v);
    if (v != Py_None) {  /* ended inside its grad-mode region */
        PyObject *r = PyObject_CallFunctionObjArgs(end_grad_fn, rt, fiber, NULL);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    if (SLOT_SET(fiber, s_glet, Py_None) < 0) goto fail;  /* the worker goes back to the pool */
    if ((v = SLOT_GET(fiber, s_joiners)) == NULL) goto fail;
    if (v != Py_None) {
        PyObject *ready = SLOT_GET(rt, s_ready), *r = NULL;
        if (ready != NULL) {
            PyObject *callargs[3] = {NULL, ready, v};
            r = PyObject_VectorcallMethod(s_extend, callargs + 1,
                                          2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_DECREF(ready);
        }
        Py_DECREF(v);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    } else {
        Py_DECREF(v);
    }
    Py_XDECREF(args);
    Py_DECREF(task);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(args);
    Py_DECREF(task);
    return NULL;
}

/* ---- ops.factory_call --------------------------------------------------------------
 * ``torch.zeros(n)`` / ``torch.ones(n)`` in instance code, rewritten by analysis
 * (FACTORY_CALLS) to ``factory_call(torch.zeros, n)``: inside a map, once the first call
 * has hoisted the constant, every later call with an int reads it from the map's hoisting
 * cache (``rt.hoisted[(func, (n,), ())]``, graph.hoist's key) here, without a Python frame
 * (DRNN: a zero state per sibling chain, 856 calls a map at b64). Anything else (the first
 * call, no map, a block's trace, another thread, a fiber inside a grad-mode region of its
 * own, a size that is not an int) is ops.factory_call itself (factory_py). */

static PyObject *factory_py_fn;
static PyObject *s_hoisted, *s_fresh;

static PyObject *setup_factory(PyObject *mod, PyObject *py) {
    Py_XSETREF(factory_py_fn, Py_NewRef(py));
    Py_RETURN_NONE;
}

/* the cached constant for func(size), a new reference; NULL without an exception on a
 * miss */
static PyObject *factory_hit(PyObject *rt, PyObject *func, PyObject *size) {
    PyObject *hoisted = SLOT_GET(rt, s_hoisted), *sizes = NULL, *key = NULL, *hit = NULL;
    if (hoisted == NULL) return NULL;
    if (!PyDict_Check(hoisted)) goto done;
    if ((sizes = PyTuple_Pack(1, size)) == NULL) goto done;
    PyObject *none = PyTuple_New(0);  /* (the empty tuple: a singleton) */
    if (none == NULL) goto done;
    key = PyTuple_Pack(3, func, sizes, none);
    Py_DECREF(none);
    if (key == NULL) goto done;
    hit = PyDict_GetItemWithError(hoisted, key);
    if (hit == NULL) goto done;
    Py_INCREF(hit);
    PyObject *fresh = SLOT_GET(rt, s_fresh);  /* another instance has it now: not fresh */
    if (fresh == NULL) {
        Py_CLEAR(hit);
        goto done;
    }
    if (PyDict_Check(fresh) && PyDict_GET_SIZE(fresh) > 0) {
        PyObject *id = PyLong_FromVoidPtr(hit);
        int err = id == NULL || (PyDict_Contains(fresh, id) == 1 && PyDict_DelItem(fresh, id) < 0);
        Py_XDECREF(id);
        if (err) Py_CLEAR(hit);
    }
    Py_DECREF(fresh);
done:
    Py_XDECREF(key);
    Py_XDECREF(sizes);
    Py_DECREF(hoisted);
    return hit;
}

static PyObject *native_factory_call(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (factory_py_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_factory was not called");
        return NULL;
    }
    if (n == 2 && PyLong_CheckExact(a[1])) {
        PyObject *fiber, *rt = recording_rt(1, &fiber);
        if (rt != NULL) {
            Py_DECREF(fiber);
            PyObject *hit = factory_hit(rt, a[0], a[1]);
            Py_DECREF(rt);
            if (hit != NULL || PyErr_Occurred()) return hit;
        } else if (PyErr_Occurred()) {
            return NULL;
        }
    }
    return PyObject_Vectorcall(factory_py_fn, a, n, NULL);
}

/* ---- fibers.fork ------------------------------------------------------------------
 * The common case of a fork in C: instance code running in a map, its fiber outside any
 * grad-mode region of its own (recording_rt's checks). The child Fiber and its Future are
 * made without their Python __init__ (their slots set here) and queued as fibers.fork
 * does; everything else is fibers.fork itself (fork_py). DRNN forks a subtree per node
 * with children: 792 forks a map at b64. */

static PyTypeObject *fiber_type, *future_type;
static PyObject *fork_py_fn;
static PyObject *s_all_fibers, *s_live, *s_append, *s_nest;
static PyObject *no_kwargs;  /* the kwargs of every fork without keywords */

static PyObject *setup_fork(PyObject *mod, PyObject *args) {
    PyObject *fb, *fu, *py;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &fb, &PyType_Type, &fu, &py)) return NULL;
    Py_INCREF(fb); Py_XSETREF(fiber_type, (PyTypeObject *)fb);
    Py_INCREF(fu); Py_XSETREF(future_type, (PyTypeObject *)fu);
    Py_INCREF(py); Py_XSETREF(fork_py_fn, py);
    Py_RETURN_NONE;
}

static PyObject *native_fork(PyObject *mod, PyObject *const *a, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (fork_py_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_fork was not called");
        return NULL;
    }
    PyObject *parent, *rt = NULL, *child = NULL, *future = NULL, *task = NULL, *v = NULL;
    if (n >= 1) rt = recording_rt(0, &parent);
    if (rt == NULL) {
        if (PyErr_Occurred()) return NULL;
        return PyObject_Vectorcall(fork_py_fn, a, nargsf, kwnames);
    }
    PyObject *args = NULL, *kwargs = NULL;
    if ((args = PyTuple_New(n - 1)) == NULL) goto done;
    for (Py_ssize_t i = 1; i < n; i++) PyTuple_SET_ITEM(args, i - 1, Py_NewRef(a[i]));
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        if ((kwargs = PyDict_New()) == NULL) goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), a[n + i]) < 0) goto done;
    } else {  /* one empty dict for every fork without keywords (a task's kwargs are only
               * read: fiber_main passes an empty one as none) */
        if (no_kwargs == NULL && (no_kwargs = PyDict_New()) == NULL) goto done;
        kwargs = Py_NewRef(no_kwargs);
    }
    if ((task = PyTuple_Pack(4, a[0], args, kwargs, Py_False)) == NULL) goto done;
    if ((child = fiber_type->tp_alloc(fiber_type, 0)) == NULL) goto done;
    PyObject *instance = SLOT_GET(parent, s_instance), *phase = NULL;
    if (instance == NULL) goto done;
    phase = SLOT_GET(parent, s_phase);
    int err = phase == NULL || SLOT_SET(child, s_instance, instance) < 0 ||
              SLOT_SET(child, s_phase, phase) < 0;
    Py_DECREF(instance);
    Py_XDECREF(phase);
    if (err || SLOT_SET(child, s_glet, Py_None) < 0 || SLOT_SET(child, s_value, Py_None) < 0 ||
        SLOT_SET(child, s_error, Py_None) < 0 || SLOT_SET(child, s_done, Py_False) < 0 ||
        SLOT_SET(child, s_waiting, Py_None) < 0 || SLOT_SET(child, s_joiners, Py_None) < 0 ||
        SLOT_SET(child, s_host, Py_None) < 0 || SLOT_SET(child, s_task, task) < 0 ||
        SLOT_SET(child, s_grad, Py_None) < 0)
        goto done;
    PyObject *zero = PyLong_FromLong(0);
    err = zero == NULL || SLOT_SET(child, s_nest, zero) < 0;
    Py_XDECREF(zero);
    if (err) goto done;
    if ((v = SLOT_GET(rt, s_all_fibers)) == NULL || PyList_Append(v, child) < 0) goto done;
    Py_CLEAR(v);
    if ((v = SLOT_GET(rt, s_live)) == NULL || PyList_Append(v, child) < 0) goto done;
    Py_CLEAR(v);
    if ((v = SLOT_GET(rt, s_ready)) == NULL) goto done;
    PyObject *callargs[3] = {NULL, v, child};
    PyObject *r = PyObject_VectorcallMethod(s_append, callargs + 1,
                                            2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) goto done;
    Py_DECREF(r);
    if ((future = future_type->tp_alloc(future_type, 0)) == NULL) goto done;
    if (SLOT_SET(future, s_fiber, child) < 0) Py_CLEAR(future);
done:
    Py_XDECREF(v);
    Py_XDECREF(child);
    Py_XDECREF(task);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    Py_DECREF(parent);
    Py_DECREF(rt);
    return future;
}

/* ---- fibers._worker's loop -------------------------------------------------------
 * worker_loop(me, pool, box): the loop of a worker greenlet ``me`` (fibers._worker), its
 * first fiber the one item of the list ``box`` (taken out: the worker must hold nothing
 * of a finished run while parked). Runs fibers (fiber_main); when one ends, runs the next
 * ready fiber itself if that has not started, else parks in ``pool`` and switches to it
 * (or to the driver); returns when the pool is full (the greenlet ends). */

static PyObject *s_FIBER_POOL, *s_appendleft;

static PyObject *worker_loop(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 3 || !PyList_Check(a[1]) || !PyList_Check(a[2]) || PyList_GET_SIZE(a[2]) != 1) {
        PyErr_SetString(PyExc_TypeError, "worker_loop(me, pool: list, box: [fiber])");
        return NULL;
    }
    PyObject *me = a[0], *pool = a[1];
    PyObject *fiber = Py_NewRef(PyList_GET_ITEM(a[2], 0));
    if (PyList_SetSlice(a[2], 0, 1, NULL) < 0) goto fail;
    for (;;) {
        PyObject *rt = graph_rt(), *nxt = NULL, *ready = NULL, *v;
        if (rt == NULL) goto fail;
        PyObject *callargs[2] = {rt, fiber};
        if ((v = fiber_main(NULL, callargs, 2)) == NULL) goto fail_rt;
        Py_DECREF(v);
        if ((v = SLOT_GET(fiber, s_error)) == NULL) goto fail_rt;
        Py_DECREF(v);
        if (v != Py_None) {  /* the driver raises it */
            if (SLOT_SET(rt, s_failed, fiber) < 0) goto fail_rt;
        } else {
            if ((ready = SLOT_GET(rt, s_ready)) == NULL) goto fail_rt;
            Py_ssize_t k = PyObject_Length(ready);
            if (k < 0) goto fail_rt;
            if (k > 0) {
                PyObject *callargs2[2] = {NULL, ready};
                nxt = PyObject_VectorcallMethod(s_popleft, callargs2 + 1,
                                                1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                if (nxt == NULL) goto fail_rt;
            }
        }
        Py_CLEAR(fiber);  /* (hold nothing of a finished run) */
        if (nxt != NULL) {
            if ((v = SLOT_GET(nxt, s_glet)) == NULL) goto fail_next;
            Py_DECREF(v);
            if (v == Py_None) {  /* not started: run it on this worker */
                if (SLOT_SET(nxt, s_glet, me) < 0 || SLOT_SET(rt, s_fiber, nxt) < 0)
                    goto fail_next;
                fiber = nxt;
                Py_XDECREF(ready);
                Py_DECREF(rt);
                continue;
            }
        }
        if ((v = PyObject_GetAttr(config_mod, s_FIBER_POOL)) == NULL) goto fail_next;
        Py_ssize_t limit = PyLong_AsSsize_t(v);
        Py_DECREF(v);
        if (limit == -1 && PyErr_Occurred()) goto fail_next;
        if (PyList_GET_SIZE(pool) >= limit) {  /* full: this greenlet ends, to the driver */
            if (nxt != NULL) {
                if (ready == NULL && (ready = SLOT_GET(rt, s_ready)) == NULL) goto fail_next;
                PyObject *callargs3[3] = {NULL, ready, nxt};
                v = PyObject_VectorcallMethod(s_appendleft, callargs3 + 1,
                                              2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
                if (v == NULL) goto fail_next;
                Py_DECREF(v);
            }
            Py_XDECREF(nxt);
            Py_XDECREF(ready);
            Py_DECREF(rt);
            Py_RETURN_NONE;
        }
        if (PyList_Append(pool, me) < 0) goto fail_next;
        PyObject *to;
        if (nxt == NULL) {
            to = SLOT_GET(rt, s_main);
        } else {
            to = SLOT_SET(rt, s_fiber, nxt) < 0 ? NULL : SLOT_GET(nxt, s_glet);
        }
        Py_XDECREF(nxt);  /* parked: hold nothing of this map */
        Py_XDECREF(ready);
        Py_DECREF(rt);
        if (to == NULL) goto fail;
        fiber = switch_to(to, NULL);  /* resumed with the next fiber to run */
        Py_DECREF(to);
        if (fiber == NULL) goto fail;  /* (thrown in: the pool's unwinding) */
        continue;
    fail_next:
        Py_XDECREF(nxt);
    fail_rt:
        Py_XDECREF(ready);
        Py_DECREF(rt);
        goto fail;
    }
fail:
    Py_XDECREF(fiber);
    return NULL;
}

static PyObject *lazy_tolist(PyObject *self, PyObject *unused) {
    return value_read(NULL, self);
}

/* tensor.LazyTensor.item: a one-element tensor's value (nested one-element lists of a
 * (1,)- or (1, 1)-shaped tensor unwrapped), else torch's ValueError */
static PyObject *lazy_item(PyObject *self, PyObject *unused) {
    PyObject *shape = ((LazyObject *)self)->shape;
    if (shape == NULL || !PyTuple_Check(shape)) {
        PyErr_SetString(PyExc_TypeError, "item(): a LazyTensor without a shape");
        return NULL;
    }
    Py_ssize_t numel = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (d == -1 && PyErr_Occurred()) return NULL;
        numel *= d;
    }
    if (numel != 1) {
        PyErr_Format(PyExc_ValueError,
                     "a Tensor with %zd elements cannot be converted to Scalar", numel);
        return NULL;
    }
    PyObject *value = value_read(NULL, self);
    while (value != NULL && PyList_Check(value)) {
        if (PyList_GET_SIZE(value) != 1) {
            PyErr_SetString(PyExc_ValueError, "item(): the value read has not one element");
            Py_DECREF(value);
            return NULL;
        }
        PyObject *first = Py_NewRef(PyList_GET_ITEM(value, 0));
        Py_DECREF(value);
        value = first;
    }
    return value;
}

/* ``convert(t.item())`` */
static PyObject *item_as(PyObject *self, PyObject *(*convert)(PyObject *)) {
    PyObject *v = lazy_item(self, NULL), *out;
    if (v == NULL) return NULL;
    out = convert(v);
    Py_DECREF(v);
    return out;
}

static PyObject *lazy_int(PyObject *self) { return item_as(self, PyNumber_Long); }

static PyObject *lazy_float(PyObject *self) { return item_as(self, PyNumber_Float); }

static int lazy_bool(PyObject *self) {
    PyObject *v = lazy_item(self, NULL);
    if (v == NULL) return -1;
    int out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return out;
}

/* ---- has_lazy: graph.has_lazy ---------------------------------------------------- */

static int has_lazy_impl(PyObject *a, int depth) {
    PyTypeObject *tp = Py_TYPE(a);
    if (tp == lazy_cls) return 1;
    if (depth > 200) {  /* deeper than any argument: let Python's recursion limit decide */
        PyErr_SetString(PyExc_RecursionError, "has_lazy: argument nested too deeply");
        return -1;
    }
    if (tp == &PyTuple_Type || tp == &PyList_Type) {
        Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
        for (Py_ssize_t i = 0; i < m; i++) {
            /* a list may change under us only through user code, which cannot run here */
            int r = has_lazy_impl(PySequence_Fast_GET_ITEM(a, i), depth + 1);
            if (r) return r;
        }
        return 0;
    }
    if (tp == &PySlice_Type) {
        PySliceObject *sl = (PySliceObject *)a;
        int r = has_lazy_impl(sl->start, depth + 1);
        if (!r) r = has_lazy_impl(sl->stop, depth + 1);
        if (!r) r = has_lazy_impl(sl->step, depth + 1);
        return r;
    }
    if (tp == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(a, &pos, &k, &v)) {
            int r = has_lazy_impl(v, depth + 1);
            if (r) return r;
        }
    }
    return 0;
}

static PyObject *has_lazy(PyObject *mod, PyObject *a) {
    int r = has_lazy_impl(a, 0);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* ---- Shortcut: a torch function's stand-in while a map runs ------------------------
 * ``torch.tanh(h)`` on a lazy tensor reaches the RecordMode through torch's C++ dispatch
 * of a Python TorchFunctionMode: ~0.9 us of argument scanning, mode-stack popping and
 * pushing before the mode's handler runs, ~1.3 us of the ~1.9 us a recorded operator
 * costs (the method ``h.tanh()``, installed on LazyTensor, costs ~0.6). While a map runs,
 * ops.fast_functions() puts a Shortcut in the torch namespaces in place of each op of
 * the table: called with a lazy tensor among its arguments on the map's thread, it does
 * what the mode's handler does (the op's special rule, else graph.record) without the
 * dispatch; called with anything else it calls the torch function as it is (the mode
 * then sees it as before). fibers.RecordMode is the specification. */

typedef struct {
    PyObject_HEAD
    PyObject *func;     /* the torch function it stands for */
    PyObject *op;       /* its ops.Op */
    PyObject *special;  /* op.special, or None */
    vectorcallfunc vectorcall;
} ShortcutObject;

static PyObject *record_fn;  /* graph.record: the checks and the block-tracing path */

static PyObject *shortcut_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    ShortcutObject *s = (ShortcutObject *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nk = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int lazy = 0;
    for (Py_ssize_t i = 0; i < n + nk && !lazy; i++) {
        lazy = has_lazy_impl(args[i], 0);
        if (lazy < 0) return NULL;
    }
    for (Py_ssize_t i = 0; i < nk && lazy; i++)  /* out=: the mode's handler (ops.out_kwarg) */
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "out") == 0) lazy = 0;
    if (!lazy || graph_mod == NULL || record_fn == NULL)
        return PyObject_Vectorcall(s->func, args, nargsf, kwnames);
    PyObject *rt = graph_rt();
    if (rt == NULL) return NULL;
    if (rt != Py_None) {  /* recorded on the map's thread only (the mode is per thread) */
        PyObject *v = SLOT_GET(rt, s_thread);
        long long t = v == NULL ? -1 : slot_value(v);
        Py_XDECREF(v);
        if (t == -1 && PyErr_Occurred()) { Py_DECREF(rt); return NULL; }
        if ((unsigned long)t != PyThread_get_thread_ident()) Py_SETREF(rt, Py_NewRef(Py_None));
    }
    if (rt == Py_None) {  /* no map here: torch's dispatch (a lazy tensor that escaped) */
        Py_DECREF(rt);
        return PyObject_Vectorcall(s->func, args, nargsf, kwnames);
    }
    PyObject *targs = PyTuple_New(n), *kwargs = PyDict_New(), *out = NULL;
    if (targs == NULL || kwargs == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(targs, i, Py_NewRef(args[i]));
    for (Py_ssize_t i = 0; i < nk; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0) goto done;
    if (s->special != Py_None) {
        out = PyObject_CallFunctionObjArgs(s->special, s->func, targs, kwargs, NULL);
        goto done;
    }
    PyObject *fiber = NULL, *live = recording_rt(0, &fiber);
    if (live != NULL) {  /* graph.record's common case: a fiber records, no block traced */
        PyObject *a[5] = {live, s->op, s->func, targs, kwargs};
        out = record_node(NULL, a, 5);
        Py_DECREF(fiber);
        Py_DECREF(live);
    } else if (!PyErr_Occurred()) {
        out = PyObject_CallFunctionObjArgs(record_fn, s->op, s->func, targs, kwargs, NULL);
    }
done:
    Py_XDECREF(targs);
    Py_XDECREF(kwargs);
    Py_DECREF(rt);
    return out;
}

static PyObject *shortcut_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *func, *op, *special;
    if (!PyArg_ParseTuple(args, "OOO:Shortcut", &func, &op, &special)) return NULL;
    ShortcutObject *s = (ShortcutObject *)tp->tp_alloc(tp, 0);
    if (s == NULL) return NULL;
    s->func = Py_NewRef(func);
    s->op = Py_NewRef(op);
    s->special = Py_NewRef(special);
    s->vectorcall = shortcut_vectorcall;
    return (PyObject *)s;
}

static int shortcut_traverse(ShortcutObject *s, visitproc visit, void *arg) {
    Py_VISIT(s->func);
    Py_VISIT(s->op);
    Py_VISIT(s->special);
    return 0;
}

static int shortcut_clear(ShortcutObject *s) {
    Py_CLEAR(s->func);
    Py_CLEAR(s->op);
    Py_CLEAR(s->special);
    return 0;
}

static void shortcut_dealloc(ShortcutObject *s) {
    PyObject_GC_UnTrack(s);
    shortcut_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* the torch function's attributes (__name__, __doc__, __module__...) show through */
static PyObject *shortcut_getattro(PyObject *self, PyObject *name) {
    PyObject *v = PyObject_GenericGetAttr(self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
    PyErr_Clear();
    return PyObject_GetAttr(((ShortcutObject *)self)->func, name);
}

static PyObject *shortcut_repr(ShortcutObject *s) {
    return PyUnicode_FromFormat("<acrobat shortcut of %R>", s->func);
}

static PyObject *shortcut_forward(PyObject *self, void *name) {
    return PyObject_GetAttrString(((ShortcutObject *)self)->func, (const char *)name);
}

static PyGetSetDef shortcut_getset[] = {  /* (class attributes of their own otherwise) */
    {"__doc__", shortcut_forward, NULL, NULL, "__doc__"},
    {"__name__", shortcut_forward, NULL, NULL, "__name__"},
    {"__qualname__", shortcut_forward, NULL, NULL, "__qualname__"},
    {"__module__", shortcut_forward, NULL, NULL, "__module__"},
    {NULL}};

static PyMemberDef shortcut_members[] = {
    {"__wrapped__", T_OBJECT_EX, offsetof(ShortcutObject, func), READONLY,
     "the torch function it stands for"},
    {"op", T_OBJECT_EX, offsetof(ShortcutObject, op), READONLY, "its ops.Op"},
    {NULL}};

static PyTypeObject ShortcutType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "acrobat._native.Shortcut",
    .tp_basicsize = sizeof(ShortcutObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Shortcut(func, op, special): func, recording its lazy calls without the "
              "TorchFunctionMode's dispatch (see ops.fast_functions)",
    .tp_new = shortcut_new,
    .tp_dealloc = (destructor)shortcut_dealloc,
    .tp_traverse = (traverseproc)shortcut_traverse,
    .tp_clear = (inquiry)shortcut_clear,
    .tp_vectorcall_offset = offsetof(ShortcutObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = shortcut_getattro,
    .tp_repr = (reprfunc)shortcut_repr,
    .tp_members = shortcut_members,
    .tp_getset = shortcut_getset,
};

static PyObject *setup_shortcuts(PyObject *mod, PyObject *record) {
    Py_INCREF(record);
    Py_XSETREF(record_fn, record);
    Py_RETURN_NONE;
}

/* ---- scheduler.prune_dead: nodes nothing can read are not executed ---------------- */

static PyObject *prune_dead(PyObject *mod, PyObject *batches) {
    if (!PyList_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "prune_dead(batches: list of lists)");
        return NULL;
    }
    Py_ssize_t dead = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(batches) - 1; i >= 0; i--) {
        PyObject *nodes = PyList_GET_ITEM(batches, i);
        if (!PyList_Check(nodes)) {
            PyErr_SetString(PyExc_TypeError, "prune_dead(batches: list of lists)");
            return NULL;
        }
        Py_ssize_t m = PyList_GET_SIZE(nodes), gone = 0;
        for (Py_ssize_t j = 0; j < m; j++)  /* referenced by its bucket alone: dead */
            gone += Py_REFCNT(PyList_GET_ITEM(nodes, j)) == 1;
        if (gone == 0) continue;
        PyObject *live = PyList_New(m - gone);
        if (live == NULL) return NULL;
        for (Py_ssize_t j = 0, k = 0; j < m; j++) {
            PyObject *nd = PyList_GET_ITEM(nodes, j);
            if (Py_REFCNT(nd) > 1) PyList_SET_ITEM(live, k++, Py_NewRef(nd));
        }
        dead += gone;
        PyList_SetItem(batches, i, live);  /* the old bucket goes, and the dead with it:
                                               their operands' nodes, earlier, may follow */
    }
    return PyLong_FromSsize_t(dead);
}


/* ---- scheduler.unneeded: buckets a demand flush leaves pending ------------------- */

/* unneeded(batches): the indices of the batches (lists of pending nodes) none of whose
 * nodes a recorded node reads (used) or a fiber has waited for (demanded) */
static PyObject *unneeded(PyObject *mod, PyObject *batches) {
    if (!PyList_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "unneeded(batches: list of lists of nodes)");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(batches); b++) {
        PyObject *nodes = PyList_GET_ITEM(batches, b);
        if (!PyList_Check(nodes)) {
            PyErr_SetString(PyExc_TypeError, "unneeded: a batch is not a list");
            Py_DECREF(out);
            return NULL;
        }
        int any = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes) && !any; i++) {
            PyObject *x = PyList_GET_ITEM(nodes, i);
            any = !IS_NODE(x) || ((NodeObject *)x)->used || ((NodeObject *)x)->demanded;
        }
        if (any) continue;
        PyObject *ix = PyLong_FromSsize_t(b);
        if (ix == NULL || PyList_Append(out, ix) < 0) {
            Py_XDECREF(ix);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(ix);
    }
    return out;
}


/* ---- executor helpers: the per-row loops of a batch ------------------------------ */

/* (col, slots), the references to both given up; NULL if packing fails. */
static PyObject *pack_columns(PyObject *col, PyObject *slots) {
    PyObject *r = PyTuple_Pack(2, col, slots);
    Py_DECREF(col);
    Py_DECREF(slots);
    return r;
}

/* col[i] = x and slots[i] = its slot (executor._slots) for a computed LazyTensor
 * operand ``x``; -1 with an exception naming ``who`` otherwise. */
static int put_operand(PyObject *x, PyObject *col, PyObject *slots, Py_ssize_t i,
                       const char *who) {
    if (!IS_LAZY(x) ||
        !IS_NODE(((LazyObject *)x)->node)) {
        PyErr_Format(PyExc_TypeError, "%s: an operand is not a LazyTensor", who);
        return -1;
    }
    long long idx = PyLong_AsLongLong(((LazyObject *)x)->idx);
    if (idx == -1 && PyErr_Occurred()) return -1;
    PyObject *slot =
        PyLong_FromLongLong(((NodeObject *)((LazyObject *)x)->node)->slot + (idx << 24));
    if (slot == NULL) return -1;
    Py_INCREF(x);
    PyList_SET_ITEM(col, i, x);
    PyList_SET_ITEM(slots, i, slot);
    return 0;
}

/* Operand ``j`` of node ``nd`` (borrowed), or NULL with an error naming ``who``. */
static PyObject *operand_at(PyObject *nd, Py_ssize_t j, const char *who) {
    if (!IS_NODE(nd)) {
        PyErr_Format(PyExc_TypeError, "%s: not a Node", who);
        return NULL;
    }
    PyObject *ins = ((NodeObject *)nd)->inputs;
    if (ins == NULL || !(PyList_CheckExact(ins) || PyTuple_CheckExact(ins)) || j < 0 ||
        j >= PySequence_Fast_GET_SIZE(ins)) {
        PyErr_Format(PyExc_IndexError, "%s: a node has no operand j", who);
        return NULL;
    }
    return PySequence_Fast_GET_ITEM(ins, j);
}

/* column(nodes, j) -> (operands, slots): operand j of every node and where each lives
 * (executor._slots: ``t.node.slot + (t.idx << 24)``; producers must be computed). */
static PyObject *column(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyList_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "column(nodes: list, j)");
        return NULL;
    }
    PyObject *nodes = a[0];
    Py_ssize_t j = PyLong_AsSsize_t(a[1]);
    if (j == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(nodes);
    PyObject *col = PyList_New(m), *slots = PyList_New(m);
    if (col == NULL || slots == NULL) goto fail;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *t = operand_at(PyList_GET_ITEM(nodes, i), j, "column");
        if (t == NULL || put_operand(t, col, slots, i, "column") < 0) goto fail;
    }
    return pack_columns(col, slots);
fail:
    Py_XDECREF(col);
    Py_XDECREF(slots);
    return NULL;
}

/* flat_column(nodes) -> (operands, slots): every operand of every node, node by node
 * (executor._run_ragged: the parts of a batch of stacks / cats of any part counts), with
 * their slots, as column() gives one operand's. */
static PyObject *flat_column(PyObject *mod, PyObject *nodes) {
    if (!PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "flat_column(nodes: list)");
        return NULL;
    }
    Py_ssize_t m = PyList_GET_SIZE(nodes), total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *nd = PyList_GET_ITEM(nodes, i);
        if (!IS_NODE(nd)) {
            PyErr_SetString(PyExc_TypeError, "flat_column: not a Node");
            return NULL;
        }
        PyObject *ins = ((NodeObject *)nd)->inputs;
        if (ins == NULL || !(PyList_CheckExact(ins) || PyTuple_CheckExact(ins))) {
            PyErr_SetString(PyExc_TypeError, "flat_column: a node's inputs are not a list");
            return NULL;
        }
        total += Py_SIZE(ins);
    }
    PyObject *col = PyList_New(total), *slots = PyList_New(total);
    if (col == NULL || slots == NULL) goto fail;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *ins = ((NodeObject *)PyList_GET_ITEM(nodes, i))->inputs;
        Py_ssize_t parts = Py_SIZE(ins);
        PyObject **items = PyList_CheckExact(ins) ? ((PyListObject *)ins)->ob_item
                                                  : ((PyTupleObject *)ins)->ob_item;
        for (Py_ssize_t j = 0; j < parts; j++, k++)
            if (put_operand(items[j], col, slots, k, "flat_column") < 0) goto fail;
    }
    return pack_columns(col, slots);
fail:
    Py_XDECREF(col);
    Py_XDECREF(slots);
    return NULL;
}

/* scan_column(nodes, first, width, j, active): sequence j's elements of a batch of
 * loops, step-major: for step t, operand first + t * width + j of the first active[t]
 * nodes; with their slots (executor.gather), as column() does for one operand. */
static PyObject *scan_column(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyList_Check(a[0]) || !PyList_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "scan_column(nodes: list, first, width, j, active: list)");
        return NULL;
    }
    PyObject *nodes = a[0], *active = a[4];
    Py_ssize_t first = PyLong_AsSsize_t(a[1]), width = PyLong_AsSsize_t(a[2]),
               j = PyLong_AsSsize_t(a[3]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(nodes), steps = PyList_GET_SIZE(active), total = 0;
    for (Py_ssize_t t = 0; t < steps; t++) {
        Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(active, t));
        if (k == -1 && PyErr_Occurred()) return NULL;
        if (k < 0 || k > m) {
            PyErr_SetString(PyExc_ValueError, "scan_column: active[t] out of range");
            return NULL;
        }
        total += k;
    }
    PyObject *col = PyList_New(total), *slots = PyList_New(total);
    if (col == NULL || slots == NULL) goto fail;
    Py_ssize_t out = 0;
    for (Py_ssize_t t = 0; t < steps; t++) {
        Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(active, t));
        Py_ssize_t pos = first + t * width + j;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *nd = PyList_GET_ITEM(nodes, i);
            if (!IS_NODE(nd)) {
                PyErr_SetString(PyExc_TypeError, "scan_column: not a Node");
                goto fail;
            }
            PyObject *ins = ((NodeObject *)nd)->inputs;
            if (ins == NULL || !(PyList_CheckExact(ins) || PyTuple_CheckExact(ins)) ||
                pos >= PySequence_Fast_GET_SIZE(ins)) {
                PyErr_SetString(PyExc_IndexError, "scan_column: a node has no such operand");
                goto fail;
            }
            if (put_operand(PySequence_Fast_GET_ITEM(ins, pos), col, slots, out, "scan_column") < 0)
                goto fail;
            out++;
        }
    }
    return pack_columns(col, slots);
fail:
    Py_XDECREF(col);
    Py_XDECREF(slots);
    return NULL;
}

/* finish_rows(nodes, outs, base, free=False): node i gets outs, row i and slot base + i
 * (executor._finish_batch). With ``free`` and outs a tuple, the nodes get a copy of it
 * of their own and an OutBlock counting the LazyTensors of each output: an output whose
 * last handle dies is released from the copy (config.FREE_OUTPUTS), now if none exists. */
static PyObject *finish_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if ((n != 3 && n != 4) || !PyList_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "finish_rows(nodes: list, outs, base, free=False)");
        return NULL;
    }
    PyObject *nodes = a[0], *outs = a[1];
    long long base = PyLong_AsLongLong(a[2]);
    if (base == -1 && PyErr_Occurred()) return NULL;
    int free_outs = n == 4 ? PyObject_IsTrue(a[3]) : 0;
    if (free_outs < 0) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < m; i++) {
        if (!IS_NODE(PyList_GET_ITEM(nodes, i))) {
            PyErr_SetString(PyExc_TypeError, "finish_rows: not a Node");
            return NULL;
        }
    }
    OutBlock *b = NULL;
    if (free_outs && m > 0 && PyTuple_CheckExact(outs) && PyTuple_GET_SIZE(outs) > 0) {
        Py_ssize_t k_out = PyTuple_GET_SIZE(outs);
        Py_ssize_t width = k_out < HANDLE_SLOTS ? k_out : HANDLE_SLOTS;
        PyObject *own = PyTuple_New(k_out);  /* (not GetSlice: for a whole exact tuple it
                                               * returns the tuple itself) */
        if (own == NULL) return NULL;
        for (Py_ssize_t k = 0; k < k_out; k++)
            PyTuple_SET_ITEM(own, k, Py_NewRef(PyTuple_GET_ITEM(outs, k)));
        b = PyMem_Malloc(sizeof(OutBlock) + (size_t)width * sizeof(Py_ssize_t));
        if (b == NULL) {
            Py_DECREF(own);
            return PyErr_NoMemory();
        }
        memset(b->live, 0, (size_t)width * sizeof(Py_ssize_t));
        b->refs = 0;
        b->width = width;
        b->pinned = 0;
        b->outs = own;
        outs = own;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        NodeObject *node = (NodeObject *)PyList_GET_ITEM(nodes, i);
        block_leave(node);  /* (given outputs again: a padded batch's rows by size) */
        Py_INCREF(outs);
        Py_XSETREF(node->outs, outs);
        node->row = i;
        node->slot = base + i;
        if (b != NULL) {
            node->block = b;
            b->refs++;
            for (Py_ssize_t k = 0; k < b->width; k++) b->live[k] += node->handles[k];
        }
    }
    if (b != NULL) {  /* (refs > 0: the nodes hold the block, and it the copy) */
        for (Py_ssize_t k = 0; k < b->width; k++)
            if (b->live[k] == 0) out_free(b, k);
    }
    Py_RETURN_NONE;
}

/* release_inputs(batches): the computed nodes of ``batches`` let go of their operands
 * (inputs and args emptied, kwargs None), so the values they read can be freed once
 * nothing else holds them (executor.execute, config.FREE_OUTPUTS) */
static PyObject *release_inputs(PyObject *mod, PyObject *batches) {
    if (!PyList_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "release_inputs(batches: list of lists of nodes)");
        return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batches); i++) {
        PyObject *nodes = PyList_GET_ITEM(batches, i);
        if (!PyList_Check(nodes)) continue;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(nodes); j++) {
            PyObject *nd = PyList_GET_ITEM(nodes, j);
            if (!IS_NODE(nd)) continue;
            NodeObject *node = (NodeObject *)nd;
            if (node->outs == NULL || node->outs == Py_None) continue;  /* (not computed) */
            Py_INCREF(empty);
            Py_XSETREF(node->inputs, empty);
            Py_INCREF(empty);
            Py_XSETREF(node->args, empty);
            Py_INCREF(Py_None);
            Py_XSETREF(node->kwargs, Py_None);
        }
    }
    Py_DECREF(empty);
    Py_RETURN_NONE;
}

/* pin(node): the outputs of node's batch are never released early (other nodes read
 * them without being counted: executor._distinct, tables in place) */
static PyObject *pin_outputs(PyObject *mod, PyObject *nd) {
    if (!IS_NODE(nd)) {
        PyErr_SetString(PyExc_TypeError, "pin(node)");
        return NULL;
    }
    OutBlock *b = ((NodeObject *)nd)->block;
    if (b != NULL) b->pinned = 1;
    Py_RETURN_NONE;
}

/* out_counts(node): (the node's handles per output < HANDLE_SLOTS, its batch's live
 * counts or None, pinned) (tests) */
static PyObject *out_counts(PyObject *mod, PyObject *nd) {
    if (!IS_NODE(nd)) {
        PyErr_SetString(PyExc_TypeError, "out_counts(node)");
        return NULL;
    }
    NodeObject *node = (NodeObject *)nd;
    OutBlock *b = node->block;
    PyObject *live = Py_None;
    Py_INCREF(live);
    if (b != NULL) {
        Py_SETREF(live, PyTuple_New(b->width));
        if (live == NULL) return NULL;
        for (Py_ssize_t k = 0; k < b->width; k++) {
            PyObject *v = PyLong_FromSsize_t(b->live[k]);
            if (v == NULL) {
                Py_DECREF(live);
                return NULL;
            }
            PyTuple_SET_ITEM(live, k, v);
        }
    }
    return Py_BuildValue("(IIII)NO", node->handles[0], node->handles[1], node->handles[2],
                         node->handles[3], live, b != NULL && b->pinned ? Py_True : Py_False);
}

/* lookup_rows(nodes, size): executor._lookup_in_place's indices, the Python int that
 * each node's first input was made from by torch.tensor(i) (ops.TENSOR), or None where
 * one is not such an int in [0, size) */
static PyObject *lookup_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyList_Check(a[0]) || tensor_op == NULL) {
        PyErr_SetString(PyExc_TypeError, "lookup_rows(nodes: list, size) after setup_values");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(a[1]);
    if (size == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(a[0]);
    PyObject *out = PyList_New(m);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *nd = PyList_GET_ITEM(a[0], i), *ins, *t, *src, *data;
        if (!IS_NODE(nd)) goto none;
        ins = ((NodeObject *)nd)->inputs;
        if (ins == NULL || !(PyList_CheckExact(ins) || PyTuple_CheckExact(ins)) ||
            PySequence_Fast_GET_SIZE(ins) < 1)
            goto none;
        t = PySequence_Fast_GET_ITEM(ins, 0);
        if (!IS_LAZY(t)) goto none;
        src = ((LazyObject *)t)->node;
        if (src == NULL || !IS_NODE(src)) goto none;
        if (((NodeObject *)src)->op != tensor_op) goto none;
        data = ((NodeObject *)src)->data;
        if (data == NULL || !PyLong_CheckExact(data)) goto none;  /* (not a bool either) */
        Py_ssize_t v = PyLong_AsSsize_t(data);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();  /* beyond any table */
            goto none;
        }
        if (v < 0 || v >= size) goto none;
        PyList_SET_ITEM(out, i, Py_NewRef(data));
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* element_repeats(column, op) -> (rep, inverse) or None: each element of a loop's
 * sequence must be output ``idx`` of a node of ``op`` (a loop over one sequence of
 * Python ints appending one value a step: scan.Scan.value_map), made from the int at
 * ``idx`` of that node's first argument (the tuple scan.Scan.record keeps); ``rep``: the
 * position of the first element of each distinct int, in order, ``inverse``: each
 * element's index into ``rep`` (scan.Scan._repeats) */
static PyObject *element_repeats(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyList_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "element_repeats(column: list, op)");
        return NULL;
    }
    PyObject *column = a[0], *op = a[1];
    Py_ssize_t m = PyList_GET_SIZE(column);
    PyObject *seen = PyDict_New(), *rep = PyList_New(0), *inverse = PyList_New(m);
    if (seen == NULL || rep == NULL || inverse == NULL) goto fail;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *t = PyList_GET_ITEM(column, i), *nd, *args, *seq, *v;
        if (!IS_LAZY(t)) goto none;
        nd = ((LazyObject *)t)->node;
        if (nd == NULL || !IS_NODE(nd) || ((NodeObject *)nd)->op != op) goto none;
        args = ((NodeObject *)nd)->args;
        if (args == NULL || !PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) goto none;
        seq = PyTuple_GET_ITEM(args, 0);
        Py_ssize_t idx = PyLong_AsSsize_t(((LazyObject *)t)->idx);
        if (idx == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto none;
        }
        if (!PyTuple_Check(seq) || idx < 0 || idx >= PyTuple_GET_SIZE(seq)) goto none;
        v = PyTuple_GET_ITEM(seq, idx);
        if (!PyLong_CheckExact(v)) goto none;  /* (not a bool, not a float: -0.0 == 0.0) */
        PyObject *got = PyDict_GetItemWithError(seen, v);  /* borrowed */
        if (got == NULL) {
            if (PyErr_Occurred()) goto fail;
            /* a new int: this element is its first */
            got = PyLong_FromSsize_t(PyList_GET_SIZE(rep));
            PyObject *pos = PyLong_FromSsize_t(i);
            int bad = got == NULL || pos == NULL || PyDict_SetItem(seen, v, got) < 0 ||
                      PyList_Append(rep, pos) < 0;
            Py_XDECREF(pos);
            Py_XDECREF(got);  /* (the dict holds it) */
            if (bad) goto fail;
        }
        PyList_SET_ITEM(inverse, i, Py_NewRef(got));
    }
    Py_DECREF(seen);
    return Py_BuildValue("(NN)", rep, inverse);
none:
    Py_DECREF(seen);
    Py_DECREF(rep);
    Py_DECREF(inverse);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(seen);
    Py_XDECREF(rep);
    Py_XDECREF(inverse);
    return NULL;
}

/* place_rows(nodes, rows, base): each node's row is rows[i] and its slot base + rows[i]
 * (executor._in_place_rows: a batch whose outputs are whole tables) */
static PyObject *place_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 3 || !PyList_Check(a[0]) || !PyList_Check(a[1]) ||
        PyList_GET_SIZE(a[0]) != PyList_GET_SIZE(a[1])) {
        PyErr_SetString(PyExc_TypeError, "place_rows(nodes: list, rows: list of one length, base)");
        return NULL;
    }
    long long base = PyLong_AsLongLong(a[2]);
    if (base == -1 && PyErr_Occurred()) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a[0]); i++) {
        PyObject *nd = PyList_GET_ITEM(a[0], i);
        if (!IS_NODE(nd)) {
            PyErr_SetString(PyExc_TypeError, "place_rows: not a Node");
            return NULL;
        }
        Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(a[1], i));
        if (r == -1 && PyErr_Occurred()) return NULL;
        ((NodeObject *)nd)->row = r;
        ((NodeObject *)nd)->slot = base + r;
    }
    Py_RETURN_NONE;
}

/* heights(batches): scheduler.relevel's pass, each node's longest path to a node nothing
 * in this flush reads (``height``; 0 at first), consumers visited before producers. */
static PyObject *heights(PyObject *mod, PyObject *batches) {
    if (!PyList_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "heights(batches: list of lists of nodes)");
        return NULL;
    }
    for (Py_ssize_t b = PyList_GET_SIZE(batches) - 1; b >= 0; b--) {
        PyObject *nodes = PyList_GET_ITEM(batches, b);
        if (!PyList_Check(nodes)) {
            PyErr_SetString(PyExc_TypeError, "heights: a batch is not a list");
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes); i++) {
            PyObject *x = PyList_GET_ITEM(nodes, i);
            if (!IS_NODE(x)) {
                PyErr_SetString(PyExc_TypeError, "heights: not a Node");
                return NULL;
            }
            NodeObject *nd = (NodeObject *)x;
            Py_ssize_t h = nd->height + 1;
            PyObject *ins = nd->inputs;
            if (ins == NULL || !(PyList_Check(ins) || PyTuple_Check(ins))) continue;
            Py_ssize_t m = PySequence_Fast_GET_SIZE(ins);
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *t = PySequence_Fast_GET_ITEM(ins, j);
                if (!IS_LAZY(t)) continue;
                PyObject *p = ((LazyObject *)t)->node;
                if (p == NULL || !IS_NODE(p)) continue;
                NodeObject *pn = (NodeObject *)p;
                if (pn->height < h && (pn->outs == NULL || pn->outs == Py_None)) pn->height = h;
            }
        }
    }
    Py_RETURN_NONE;
}

/* relift(nodes, op, sig, info, consts): scheduler._join's rewrite of a lifted trace's
 * nodes as calls of the trace ``op`` (signature ``sig``, ``info``): each node's inputs
 * with the constants ``consts`` ((position, LazyTensor) pairs, positions ascending)
 * inserted, and its op, sig and info replaced. DRNN's first siblings (a zero h_f) are
 * ~850 such nodes a map at b64: 0.25 ms in Python, ~0.03 here. */
static PyObject *relift(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyList_Check(a[0]) || !PyList_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "relift(nodes: list, op, sig, info, consts: list)");
        return NULL;
    }
    PyObject *nodes = a[0], *op = a[1], *sig = a[2], *info = a[3], *consts = a[4];
    Py_ssize_t nc = PyList_GET_SIZE(consts);
    Py_ssize_t pos[16];
    PyObject *val[16];
    if (nc > 16) {
        PyErr_SetString(PyExc_ValueError, "relift: at most 16 constants");
        return NULL;
    }
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *pair = PyList_GET_ITEM(consts, c);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "relift: a constant is a (position, tensor) pair");
            return NULL;
        }
        pos[c] = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        if (pos[c] == -1 && PyErr_Occurred()) return NULL;
        if (pos[c] < 0 || (c > 0 && pos[c] <= pos[c - 1])) {
            PyErr_SetString(PyExc_ValueError, "relift: positions must ascend from 0");
            return NULL;
        }
        val[c] = PyTuple_GET_ITEM(pair, 1);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes); i++) {
        PyObject *x = PyList_GET_ITEM(nodes, i);
        if (!IS_NODE(x)) {
            PyErr_SetString(PyExc_TypeError, "relift: not a Node");
            return NULL;
        }
        NodeObject *nd = (NodeObject *)x;
        PyObject *ins = nd->inputs;
        if (ins == NULL || !(PyList_Check(ins) || PyTuple_Check(ins))) {
            PyErr_SetString(PyExc_TypeError, "relift: a node's inputs are not a list");
            return NULL;
        }
        Py_ssize_t m = PySequence_Fast_GET_SIZE(ins), total = m + nc;
        PyObject *out = PyTuple_New(total);
        if (out == NULL) return NULL;
        Py_ssize_t src = 0, c = 0;
        for (Py_ssize_t j = 0; j < total; j++) {  /* list.insert at each position in turn */
            PyObject *v;
            if (c < nc && (pos[c] == j || src >= m)) {
                v = val[c++];
            } else {
                v = PySequence_Fast_GET_ITEM(ins, src++);
            }
            Py_INCREF(v);
            PyTuple_SET_ITEM(out, j, v);
        }
        Py_SETREF(nd->inputs, out);
        Py_INCREF(op);
        Py_SETREF(nd->op, op);
        Py_INCREF(sig);
        Py_SETREF(nd->sig, sig);
        Py_INCREF(info);
        Py_SETREF(nd->info, info);
    }
    Py_RETURN_NONE;
}

/* What ``bases`` holds for the buffer LazyTensor ``t`` reads (executor._note_bases):
 * row 0's address when a byte copy reads its rows (a contiguous CPU tensor of rows of
 * ``dtype`` and ``shape``), else None. A new reference. */
static PyObject *s_device, *s_type, *s_cpu, *s_is_contiguous, *s_dtype, *s_shape, *s_data_ptr,
    *s_itemsize;

static PyObject *source_base(PyObject *t, PyObject *shape, PyObject *dtype) {
    NodeObject *node = (NodeObject *)((LazyObject *)t)->node;
    Py_ssize_t idx = PyLong_AsSsize_t(((LazyObject *)t)->idx);
    if (idx == -1 && PyErr_Occurred()) return NULL;
    PyObject *buf = PySequence_GetItem(node->outs, idx);
    if (buf == NULL) return NULL;
    PyObject *result = NULL, *device = NULL, *kind = NULL, *dt = NULL, *shp = NULL;
    int ok = 1;
    if ((device = PyObject_GetAttr(buf, s_device)) == NULL) goto done;
    if ((kind = PyObject_GetAttr(device, s_type)) == NULL) goto done;
    ok = PyObject_RichCompareBool(kind, s_cpu, Py_EQ);
    if (ok == 1) {
        PyObject *c = PyObject_CallMethodNoArgs(buf, s_is_contiguous);
        if (c == NULL) goto done;
        ok = PyObject_IsTrue(c);
        Py_DECREF(c);
    }
    if (ok == 1) {
        if ((dt = PyObject_GetAttr(buf, s_dtype)) == NULL) goto done;
        ok = PyObject_RichCompareBool(dt, dtype, Py_EQ);
    }
    if (ok == 1) {
        if ((shp = PyObject_GetAttr(buf, s_shape)) == NULL) goto done;
        Py_ssize_t r = PyTuple_Check(shp) ? PyTuple_GET_SIZE(shp) : -1;
        Py_ssize_t want = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -2;
        ok = r == want + 1;
        for (Py_ssize_t i = 0; ok == 1 && i < want; i++)
            ok = PyObject_RichCompareBool(PyTuple_GET_ITEM(shp, i + 1),
                                          PyTuple_GET_ITEM(shape, i), Py_EQ);
    }
    if (ok < 0) goto done;
    if (ok) {
        result = PyObject_CallMethodNoArgs(buf, s_data_ptr);
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    Py_DECREF(buf);
    Py_XDECREF(device);
    Py_XDECREF(kind);
    Py_XDECREF(dt);
    Py_XDECREF(shp);
    return result;
}

/* The bases entries one call has read, batch key -> row 0's address: the rows of a
 * batch's operand come from a few source batches, in any order (a DRNN stack's 1,574
 * logits rows from 13 node batches), each a dict lookup with a new int key before. */
#define BASE_WAYS 8
typedef struct {
    long long key[BASE_WAYS];
    char *base[BASE_WAYS];
    int n, next;
} BaseCache;

/* *out = row 0's address of the buffer of batch ``key`` (bases[key], entered from
 * source_base(t, ...) the first time; ``t`` one of its LazyTensors): 1, or 0 where the
 * buffer cannot be read by address, or -1 with an exception set. */
static int base_of(BaseCache *c, long long key, PyObject *bases, PyObject *t, PyObject *shape,
                   PyObject *dtype, char **out) {
    for (int w = 0; w < c->n; w++)
        if (c->key[w] == key) {
            *out = c->base[w];
            return 1;
        }
    PyObject *k = PyLong_FromLongLong(key);
    if (k == NULL) return -1;
    PyObject *b = PyDict_GetItemWithError(bases, k); /* borrowed */
    if (b == NULL && !PyErr_Occurred()) {
        if (!IS_LAZY(t)) {
            PyErr_SetString(PyExc_TypeError, "copy_rows: ts must hold LazyTensors");
        } else if ((b = source_base(t, shape, dtype)) != NULL) {
            int err = PyDict_SetItem(bases, k, b);
            Py_DECREF(b); /* the dict holds it */
            if (err < 0) b = NULL;
        }
    }
    Py_DECREF(k);
    if (b == NULL) return -1;
    if (b == Py_None) return 0;
    char *p = (char *)PyLong_AsVoidPtr(b);
    if (p == NULL && PyErr_Occurred()) return -1;
    c->key[c->next] = key;
    c->base[c->next] = p;
    c->next = (c->next + 1) % BASE_WAYS;
    if (c->n < BASE_WAYS) c->n++;
    *out = p;
    return 1;
}

/* copy_rows(dst, slots, bases, nbytes, ts, shape, dtype): row i of the buffer at address
 * ``dst`` (len(slots) rows) gets the ``nbytes`` bytes of the row slot i names,
 * ``bases[slot >> 24] + (slot & 0xFFFFFF) * nbytes``: the rows of LazyTensors ``ts``
 * (computed, all of ``shape`` and ``dtype``; executor._native_copy). ``slots`` are their
 * executor._slots, and
 * ``bases`` caches each source buffer's row-0 address (source_base), entered here the
 * first time a source is read. Every row's address is found before any is copied: a
 * source that a byte copy cannot read (None) makes the answer False, nothing copied. */
/* The address of each row ``slots`` names (see copy_rows) into ``src``: 1, or 0 where a
 * source cannot be read by address, or -1 with an exception set. */
static int row_pointers_at(PyObject *slots, PyObject *bases, PyObject *ts, PyObject *shape,
                           PyObject *dtype, Py_ssize_t nbytes, char **src, Py_ssize_t start,
                           Py_ssize_t count) {
    BaseCache cache = {{0}, {NULL}, 0, 0};
    for (Py_ssize_t i = start; i < start + count; i++) {
        long long slot = slot_value(PyList_GET_ITEM(slots, i));
        if (slot == -1 && PyErr_Occurred()) return -1;
        char *base;
        int r = base_of(&cache, slot >> 24, bases, PyList_GET_ITEM(ts, i), shape, dtype, &base);
        if (r <= 0) return r;
        src[i] = base + (slot & 0xFFFFFF) * nbytes;
    }
    return 1;
}

/* The address of operand ``j`` of each node of ``nodes`` (a list; computed LazyTensors
 * of ``shape`` and ``dtype``, ``nbytes`` each) into ``src``: column() and row_pointers()
 * without their lists of operands and slot ints. 1, 0 (a source that cannot be read by
 * address), or -1 with an exception naming ``who``. */
/* The address of the row computed LazyTensor ``t`` names into *src: 1, 0 (its source
 * cannot be read by address), or -1 with an exception naming ``who``. */
static int operand_pointer(PyObject *t, BaseCache *cache, PyObject *bases, PyObject *shape,
                           PyObject *dtype, Py_ssize_t nbytes, char **src, const char *who) {
    if (!IS_LAZY(t) || !IS_NODE(((LazyObject *)t)->node)) {
        PyErr_Format(PyExc_TypeError, "%s: an operand is not a LazyTensor", who);
        return -1;
    }
    long long idx = PyLong_AsLongLong(((LazyObject *)t)->idx);
    if (idx == -1 && PyErr_Occurred()) return -1;
    long long slot = ((NodeObject *)((LazyObject *)t)->node)->slot + (idx << 24);
    char *base;
    int r = base_of(cache, slot >> 24, bases, t, shape, dtype, &base);
    if (r == 1) *src = base + (slot & 0xFFFFFF) * nbytes;
    return r;
}

static int operand_pointers(PyObject *nodes, Py_ssize_t j, PyObject *bases, PyObject *shape,
                            PyObject *dtype, Py_ssize_t nbytes, char **src, const char *who) {
    BaseCache cache = {{0}, {NULL}, 0, 0};
    Py_ssize_t m = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *t = operand_at(PyList_GET_ITEM(nodes, i), j, who);
        if (t == NULL) return -1;
        int r = operand_pointer(t, &cache, bases, shape, dtype, nbytes, src + i, who);
        if (r <= 0) return r;
    }
    return 1;
}

/* row_pointers_at over all of ``slots`` */
static int row_pointers(PyObject *slots, PyObject *bases, PyObject *ts, PyObject *shape,
                        PyObject *dtype, Py_ssize_t nbytes, char **src) {
    return row_pointers_at(slots, bases, ts, shape, dtype, nbytes, src, 0,
                           PyList_GET_SIZE(slots));
}

/* copy_rows's and row_addresses's arguments: 1 if
 * well formed, else 0 with TypeError */
static int rows_args(PyObject *const *a, Py_ssize_t n, const char *name) {
    if (n != 7 || !PyList_Check(a[1]) || !PyDict_Check(a[2]) || !PyList_Check(a[4]) ||
        PyList_GET_SIZE(a[4]) != PyList_GET_SIZE(a[1])) {
        PyErr_Format(PyExc_TypeError,
                     "%s(dst, slots: list, bases: dict, nbytes, ts: list, shape, dtype)", name);
        return 0;
    }
    return 1;
}

/* copy_rows(dst, slots, bases, nbytes, ts, shape, dtype): the rows of ``slots`` copied
 * to ``dst`` back to back: True, False (a source that cannot be read by address; nothing
 * copied), or NULL with an exception set. */
static PyObject *copy_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (!rows_args(a, n, "copy_rows")) return NULL;
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[3]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(a[1]);
    char **src = PyMem_Malloc((size_t)(m > 0 ? m : 1) * sizeof(char *));
    if (src == NULL) return PyErr_NoMemory();
    int found = row_pointers(a[1], a[2], a[4], a[5], a[6], nbytes, src);
    if (found == 1)
        for (Py_ssize_t i = 0; i < m; i++) memcpy(dst + i * nbytes, src[i], (size_t)nbytes);
    PyMem_Free(src);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* pad_rows(dst, stride, rows, slots, bases, nbytes, ts, shape, dtype[, parts, inner]):
 * the rows of ``slots`` (each ``nbytes``, of ``shape`` and ``dtype``) copied by address
 * to ``dst + rows[i] * stride``: a padded batch's members written at the start of their
 * rows (executor._pad_into). With ``parts`` and ``inner``: each row in ``parts`` equal
 * pieces, piece j to ``dst + rows[i] * stride + j * inner`` (a member ragged in its first
 * two dims, an n x n adjacency, into an N x N one). True, False (a source that cannot be
 * read by address; nothing copied), or NULL with an exception set. */
static PyObject *pad_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if ((n != 9 && n != 11) || !PyList_Check(a[2]) || !PyList_Check(a[3]) ||
        !PyDict_Check(a[4]) || !PyList_Check(a[6]) ||
        PyList_GET_SIZE(a[2]) != PyList_GET_SIZE(a[3]) ||
        PyList_GET_SIZE(a[6]) != PyList_GET_SIZE(a[3])) {
        PyErr_SetString(PyExc_TypeError, "pad_rows(dst, stride, rows: list, slots: list, "
                                         "bases: dict, nbytes, ts: list, shape, dtype"
                                         "[, parts, inner])");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(a[1]);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[5]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t parts = 1, inner = 0;
    if (n == 11) {
        parts = PyLong_AsSsize_t(a[9]);
        inner = PyLong_AsSsize_t(a[10]);
        if ((parts == -1 || inner == -1) && PyErr_Occurred()) return NULL;
        if (parts < 1 || nbytes % parts != 0) {
            PyErr_SetString(PyExc_ValueError, "pad_rows: parts must divide nbytes");
            return NULL;
        }
    }
    Py_ssize_t piece = nbytes / parts;
    Py_ssize_t m = PyList_GET_SIZE(a[3]);
    char **src = PyMem_Malloc((size_t)(m > 0 ? m : 1) * sizeof(char *));
    if (src == NULL) return PyErr_NoMemory();
    int found = row_pointers(a[3], a[4], a[6], a[7], a[8], nbytes, src);
    for (Py_ssize_t i = 0; found == 1 && i < m; i++) {
        Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(a[2], i));
        if (r == -1 && PyErr_Occurred()) {
            found = -1;
        } else if (parts == 1) {
            memcpy(dst + r * stride, src[i], (size_t)nbytes);
        } else {
            for (Py_ssize_t j = 0; j < parts; j++)
                memcpy(dst + r * stride + j * inner, src[i] + j * piece, (size_t)piece);
        }
    }
    PyMem_Free(src);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* The ints of list ``a`` (``m`` of them) into ``out``: 1, or 0 with an exception set. */
static int ssize_list(PyObject *a, Py_ssize_t m, Py_ssize_t *out) {
    for (Py_ssize_t p = 0; p < m; p++) {
        out[p] = PyLong_AsSsize_t(PyList_GET_ITEM(a, p));
        if (out[p] == -1 && PyErr_Occurred()) return 0;
    }
    return 1;
}

/* pad_parts(dst, stride, slots, bases, ts, dtype, counts, shapes, nbytes): one ragged
 * argument of a padded batch written in one call (executor._pad_parts): the members of
 * part p (the next ``counts[p]`` of ``slots``, each of ``shapes[p]``, ``nbytes[p]`` bytes)
 * copied by address to the start of their rows, member i at ``dst + i * stride``. True,
 * False (a source that cannot be read by address; nothing copied), or NULL with an
 * exception set. */
static PyObject *pad_parts(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 9 || !PyList_Check(a[2]) || !PyDict_Check(a[3]) || !PyList_Check(a[4]) ||
        !PyList_Check(a[6]) || !PyList_Check(a[7]) || !PyList_Check(a[8]) ||
        PyList_GET_SIZE(a[4]) != PyList_GET_SIZE(a[2]) ||
        PyList_GET_SIZE(a[7]) != PyList_GET_SIZE(a[6]) ||
        PyList_GET_SIZE(a[8]) != PyList_GET_SIZE(a[6])) {
        PyErr_SetString(PyExc_TypeError, "pad_parts(dst, stride, slots: list, bases: dict, "
                                         "ts: list, dtype, counts: list, shapes: list, "
                                         "nbytes: list)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(a[1]);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(a[2]), parts = PyList_GET_SIZE(a[6]);
    char **src = PyMem_Malloc((size_t)(m > 0 ? m : 1) * sizeof(char *));
    Py_ssize_t *sizes = PyMem_Malloc((size_t)(2 * parts + 1) * sizeof(Py_ssize_t));
    if (src == NULL || sizes == NULL) {
        PyMem_Free(src);
        PyMem_Free(sizes);
        return PyErr_NoMemory();
    }
    Py_ssize_t *counts = sizes, *nbytes = sizes + parts;
    int found = ssize_list(a[6], parts, counts) && ssize_list(a[8], parts, nbytes) ? 1 : -1;
    Py_ssize_t start = 0;
    for (Py_ssize_t p = 0; found == 1 && p < parts; p++) {
        if (counts[p] < 0 || start + counts[p] > m) {
            PyErr_SetString(PyExc_ValueError, "pad_parts: counts must sum to len(slots)");
            found = -1;
            break;
        }
        if (nbytes[p] < 0 || nbytes[p] > stride) {
            PyErr_SetString(PyExc_ValueError, "pad_parts: a member longer than its row");
            found = -1;
            break;
        }
        found = row_pointers_at(a[2], a[3], a[4], PyList_GET_ITEM(a[7], p), a[5], nbytes[p],
                                src, start, counts[p]);
        start += counts[p];
    }
    if (found == 1 && start != m) {
        PyErr_SetString(PyExc_ValueError, "pad_parts: counts must sum to len(slots)");
        found = -1;
    }
    if (found == 1) {
        Py_ssize_t i = 0;
        for (Py_ssize_t p = 0; p < parts; p++)
            for (Py_ssize_t j = 0; j < counts[p]; j++, i++)
                memcpy(dst + i * stride, src[i], (size_t)nbytes[p]);
    }
    PyMem_Free(src);
    PyMem_Free(sizes);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* pick_rows(dst, rowbytes, slots, bases, ts, dtype, shapes, nbytes, offsets): ``x[i]`` of
 * values of any leading sizes, one row each (executor._native_picks): value k (``ts[k]``,
 * of ``shapes[k]``, ``nbytes[k]`` bytes, found by its slot as copy_rows finds rows) gives
 * the ``rowbytes`` bytes at ``offsets[k]`` into it, written at ``dst + k * rowbytes``. True,
 * False (a source that cannot be read by address; nothing copied), or NULL with an
 * exception set. */
static PyObject *pick_rows(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 9 || !PyList_Check(a[2]) || !PyDict_Check(a[3]) || !PyList_Check(a[4]) ||
        !PyList_Check(a[6]) || !PyList_Check(a[7]) || !PyList_Check(a[8]) ||
        PyList_GET_SIZE(a[4]) != PyList_GET_SIZE(a[2]) ||
        PyList_GET_SIZE(a[6]) != PyList_GET_SIZE(a[2]) ||
        PyList_GET_SIZE(a[7]) != PyList_GET_SIZE(a[2]) ||
        PyList_GET_SIZE(a[8]) != PyList_GET_SIZE(a[2])) {
        PyErr_SetString(PyExc_TypeError, "pick_rows(dst, rowbytes, slots: list, bases: dict, "
                                         "ts: list, dtype, shapes: list, nbytes: list, "
                                         "offsets: list)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t rowbytes = PyLong_AsSsize_t(a[1]);
    if (rowbytes == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(a[2]);
    char **src = PyMem_Malloc((size_t)(m > 0 ? m : 1) * sizeof(char *));
    Py_ssize_t *sizes = PyMem_Malloc((size_t)(2 * m + 1) * sizeof(Py_ssize_t));
    if (src == NULL || sizes == NULL) {
        PyMem_Free(src);
        PyMem_Free(sizes);
        return PyErr_NoMemory();
    }
    Py_ssize_t *nbytes = sizes, *offsets = sizes + m;
    int found = ssize_list(a[7], m, nbytes) && ssize_list(a[8], m, offsets) ? 1 : -1;
    for (Py_ssize_t k = 0; found == 1 && k < m; k++) {
        if (offsets[k] < 0 || rowbytes < 0 || offsets[k] + rowbytes > nbytes[k]) {
            PyErr_SetString(PyExc_ValueError, "pick_rows: a row past its value's end");
            found = -1;
            break;
        }
        found = row_pointers_at(a[2], a[3], a[4], PyList_GET_ITEM(a[6], k), a[5], nbytes[k],
                                src, k, 1);
    }
    if (found == 1)
        for (Py_ssize_t k = 0; k < m; k++)
            memcpy(dst + k * rowbytes, src[k] + offsets[k], (size_t)rowbytes);
    PyMem_Free(src);
    PyMem_Free(sizes);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* unpad_parts(src, stride, dst, counts, nbytes): a padded batch's ragged output cut back
 * to its members' sizes (executor._cut_parts): row i (at ``src + i * stride``), a member
 * of part p (the next ``counts[p]`` rows), gives its first ``nbytes[p]`` bytes, written
 * back to back from ``dst``. */
static PyObject *unpad_parts(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyList_Check(a[3]) || !PyList_Check(a[4]) ||
        PyList_GET_SIZE(a[3]) != PyList_GET_SIZE(a[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "unpad_parts(src, stride, dst, counts: list, nbytes: list)");
        return NULL;
    }
    char *src = (char *)PyLong_AsVoidPtr(a[0]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(a[1]);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    char *dst = (char *)PyLong_AsVoidPtr(a[2]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t parts = PyList_GET_SIZE(a[3]);
    Py_ssize_t *sizes = PyMem_Malloc((size_t)(2 * parts + 1) * sizeof(Py_ssize_t));
    if (sizes == NULL) return PyErr_NoMemory();
    Py_ssize_t *counts = sizes, *nbytes = sizes + parts;
    int ok = ssize_list(a[3], parts, counts) && ssize_list(a[4], parts, nbytes);
    for (Py_ssize_t p = 0; ok && p < parts; p++) {
        if (counts[p] < 0 || nbytes[p] < 0 || nbytes[p] > stride) {
            PyErr_SetString(PyExc_ValueError, "unpad_parts: a part's rows longer than stride");
            ok = 0;
        }
    }
    for (Py_ssize_t p = 0; ok && p < parts; p++)
        for (Py_ssize_t j = 0; j < counts[p]; j++) {
            memcpy(dst, src, (size_t)nbytes[p]);
            dst += nbytes[p];
            src += stride;
        }
    PyMem_Free(sizes);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ---- numba kernels on torch's OpenMP team (acrobat_kernels/parallel.py) -----------
 * parallel.run in C: the kernel's parameter block made on the C stack and GOMP_parallel
 * of the libgomp torch loaded called directly (through ctypes, a Params array and the
 * call's argument conversions cost ~2.5 us a kernel, ~48 a DRNN map). */

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel;
static long long omp_queries[2];

/* setup_omp(GOMP_parallel, omp_get_thread_num, omp_get_num_threads): their addresses */
static PyObject *setup_omp(PyObject *mod, PyObject *args) {
    unsigned long long start, thread_num, num_threads;
    if (!PyArg_ParseTuple(args, "KKK", &start, &thread_num, &num_threads)) return NULL;
    gomp_parallel = (gomp_parallel_fn)(uintptr_t)start;
    omp_queries[0] = (long long)thread_num;
    omp_queries[1] = (long long)num_threads;
    Py_RETURN_NONE;
}

/* omp_run(entry, threads, *ints): the cfunc at ``entry`` run on ``threads`` threads of
 * torch's team with the parameter block parallel.params(*ints) makes (at most 14 ints,
 * then the two OpenMP queries), the GIL released */
static PyObject *omp_run(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (gomp_parallel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_omp was not called");
        return NULL;
    }
    if (n < 2 || n - 2 > 14) {
        PyErr_SetString(PyExc_TypeError, "omp_run(entry, threads, *ints): at most 14 ints");
        return NULL;
    }
    void *entry = PyLong_AsVoidPtr(a[0]);
    long threads = PyLong_AsLong(a[1]);
    if (PyErr_Occurred()) return NULL;
    if (entry == NULL || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "omp_run: no kernel, or no thread");
        return NULL;
    }
    long long block[16] = {0};
    for (Py_ssize_t i = 2; i < n; i++) {
        block[i - 2] = PyLong_AsLongLong(a[i]);
        if (block[i - 2] == -1 && PyErr_Occurred()) return NULL;
    }
    block[14] = omp_queries[0];
    block[15] = omp_queries[1];
    Py_BEGIN_ALLOW_THREADS
    gomp_parallel((void (*)(void *))entry, block, (unsigned)threads, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- a map's results (fibers._materialize) ---------------------------------------
 * materialize(value): fibers._materialize's common cases in C: a computed LazyTensor of a
 * batch no other node may read (its outputs not in rt.shared) without a grad-mode tag of
 * its own is its row of the batch's output (torch's indexing, as in Python); tensors and
 * plain values (numbers, strings, None, sizes, dtypes, devices, bytes, ranges) are
 * returned as they are; lists and tuples (exact types) of those element by element (a
 * list of plain values copied, a tuple of them returned as is). The sentinel given to
 * setup_materialize where any part is something else: the caller runs the Python version
 * on the whole value. ~2.3 µs an instance's (logits, parents) in Python. */
static PyObject *mat_miss, *mat_plain, *mat_tensor, *mat_gradtag, *s_shared;

/* setup_materialize(miss, plain types: frozenset, torch.Tensor, graph.GradTag) */
static PyObject *setup_materialize(PyObject *mod, PyObject *args) {
    PyObject *miss, *plain, *tensor, *tag;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &miss, &PyFrozenSet_Type, &plain, &PyType_Type,
                          &tensor, &PyType_Type, &tag))
        return NULL;
    Py_XSETREF(mat_miss, Py_NewRef(miss));
    Py_XSETREF(mat_plain, Py_NewRef(plain));
    Py_XSETREF(mat_tensor, Py_NewRef(tensor));
    Py_XSETREF(mat_gradtag, Py_NewRef(tag));
    if (s_shared == NULL && (s_shared = PyUnicode_InternFromString("shared")) == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* a new reference: the value, mat_miss (a new reference too), or NULL on an error */
static PyObject *mat_value(PyObject *v, int depth) {
    PyTypeObject *t = Py_TYPE(v);
    if (t == lazy_cls) {
        NodeObject *nd = (NodeObject *)((LazyObject *)v)->node;
        if (!Py_IS_TYPE((PyObject *)nd, &NodeType) && !PyObject_TypeCheck(nd, &NodeType))
            return Py_NewRef(mat_miss);
        PyObject *outs = nd->outs, *sig = nd->sig;
        if (outs == NULL || outs == Py_None || nd->rt == NULL) return Py_NewRef(mat_miss);
        if (sig != NULL && PyTuple_Check(sig) && PyTuple_GET_SIZE(sig) > 0 &&
            Py_IS_TYPE(PyTuple_GET_ITEM(sig, 0), (PyTypeObject *)mat_gradtag))
            return Py_NewRef(mat_miss);  /* a grad-mode region's node: Python's */
        PyObject *shared = SLOT_GET(nd->rt, s_shared);
        if (shared == NULL) return NULL;
        int in = 0;
        if (PyAnySet_Check(shared) && PySet_GET_SIZE(shared) > 0) {
            PyObject *id = PyLong_FromVoidPtr(outs);
            in = id == NULL ? -1 : PySet_Contains(shared, id);
            Py_XDECREF(id);
        } else if (!PyAnySet_Check(shared)) {
            in = 1;
        }
        Py_DECREF(shared);
        if (in < 0) return NULL;
        if (in) return Py_NewRef(mat_miss);  /* a row others may read: Python clones it */
        PyObject *buf = PyObject_GetItem(outs, ((LazyObject *)v)->idx);
        if (buf == NULL) return NULL;
        PyObject *row = PyLong_FromSsize_t(nd->row);
        PyObject *r = row == NULL ? NULL : PyObject_GetItem(buf, row);
        Py_XDECREF(row);
        Py_DECREF(buf);
        return r;
    }
    int plain = PySet_Contains(mat_plain, (PyObject *)t);
    if (plain < 0) return NULL;
    if (plain) return Py_NewRef(v);
    int tensor = PyObject_IsInstance(v, mat_tensor);
    if (tensor < 0) return NULL;
    if (tensor) return Py_NewRef(v);
    if ((t != &PyList_Type && t != &PyTuple_Type) || depth > 32) return Py_NewRef(mat_miss);
    Py_ssize_t n = Py_SIZE(v);
    PyObject **items = t == &PyList_Type ? ((PyListObject *)v)->ob_item
                                         : ((PyTupleObject *)v)->ob_item;
    int all_plain = 1;
    for (Py_ssize_t i = 0; i < n && all_plain; i++) {
        int p = PySet_Contains(mat_plain, (PyObject *)Py_TYPE(items[i]));
        if (p < 0) return NULL;
        all_plain = p;
    }
    if (all_plain) return t == &PyList_Type ? PyList_GetSlice(v, 0, n) : Py_NewRef(v);
    PyObject *out = t == &PyList_Type ? PyList_New(n) : PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* (a list's items re-read each time: nothing here runs user code that resizes it,
         * but torch's indexing could in principle; a changed size is a miss) */
        if (Py_SIZE(v) != n) {
            Py_DECREF(out);
            return Py_NewRef(mat_miss);
        }
        PyObject *item = t == &PyList_Type ? PyList_GET_ITEM(v, i) : PyTuple_GET_ITEM(v, i);
        Py_INCREF(item);
        PyObject *r = mat_value(item, depth + 1);
        Py_DECREF(item);
        if (r == NULL || r == mat_miss) {
            Py_DECREF(out);
            return r;
        }
        if (t == &PyList_Type)
            PyList_SET_ITEM(out, i, r);
        else
            PyTuple_SET_ITEM(out, i, r);
    }
    return out;
}

static PyObject *materialize(PyObject *mod, PyObject *value) {
    if (mat_miss == NULL || lazy_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "acrobat._native.setup_materialize was not called");
        return NULL;
    }
    return mat_value(value, 0);
}

/* ---- the GEMM calls of ops.batched_linear & co (acrobat_kernels/gemm.py) ------------
 * gemm_call(kind, x, W, c): kind 0 ``linear(x, W, c)`` (c the bias or None), 1 its tanh,
 * 2 ``addmm(c, x, W.T)`` (c the (rows, N) addend), 3 its tanh. Where gemm._usable holds
 * for a 2-D ``x`` without autograd recording and the online choice (ops._GEMM_DECIDED)
 * took the kernel for the call's key: the product as gemm._run makes it (split over
 * torch's threads where it pays, else the thread-split entry on this thread alone, the
 * same loops gemm._run's single-thread call runs), a new (rows, N) tensor. The string
 * "torch" where the choice took torch's GEMM; None where any of it does not hold (the
 * caller's Python path decides, trials included). Through the Python wrappers the same
 * checks, key and call cost ~6 µs a GEMM (48 GEMMs a DRNN map). */
static PyObject *gemm_ops, *gemm_mod;  /* acrobat.ops' and acrobat_kernels.gemm's dicts */
static PyObject *gemm_finite, *gemm_empty, *gemm_threads, *gemm_grad_on, *gemm_f32,
    *gemm_tensor, *gemm_param, *gemm_kinds[4], *gemm_kernel_s, *gemm_torch_s;
static PyObject *s_is_cpu, *s_requires_grad, *s_stride, *s_GEMM_DECIDED, *s_gparallel,
    *s_PARALLEL_WORK, *s_COLUMNS_BELOW, *s_CUT_ZEROS, *s_MAX_ROWS, *dtype_kw;

/* setup_gemm(ops.__dict__, gemm.__dict__, gemm._finite, torch.empty,
 *            torch.get_num_threads, torch.is_grad_enabled, torch.float32,
 *            torch.Tensor, torch.nn.Parameter) */
static PyObject *setup_gemm(PyObject *mod, PyObject *args) {
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOO!O!", &PyDict_Type, &o[0], &PyDict_Type, &o[1],
                          &o[2], &o[3], &o[4], &o[5], &o[6], &PyType_Type, &o[7],
                          &PyType_Type, &o[8]))
        return NULL;
    PyObject **dst[9] = {&gemm_ops, &gemm_mod, &gemm_finite, &gemm_empty, &gemm_threads,
                         &gemm_grad_on, &gemm_f32, &gemm_tensor, &gemm_param};
    for (int i = 0; i < 9; i++) Py_XSETREF(*dst[i], Py_NewRef(o[i]));
    static const char *kinds[4] = {"linear", "linear_tanh", "addmm", "addmm_tanh"};
    for (int i = 0; i < 4; i++)
        if (gemm_kinds[i] == NULL &&
            (gemm_kinds[i] = PyUnicode_InternFromString(kinds[i])) == NULL)
            return NULL;
#define GEMM_INTERN(v, s) if (v == NULL && (v = PyUnicode_InternFromString(s)) == NULL) return NULL
    GEMM_INTERN(gemm_kernel_s, "kernel");
    GEMM_INTERN(gemm_torch_s, "torch");
    GEMM_INTERN(s_is_cpu, "is_cpu");
    GEMM_INTERN(s_requires_grad, "requires_grad");
    GEMM_INTERN(s_stride, "stride");
    GEMM_INTERN(s_GEMM_DECIDED, "_GEMM_DECIDED");
    GEMM_INTERN(s_gparallel, "_parallel");
    GEMM_INTERN(s_PARALLEL_WORK, "PARALLEL_WORK");
    GEMM_INTERN(s_COLUMNS_BELOW, "COLUMNS_BELOW");
    GEMM_INTERN(s_CUT_ZEROS, "CUT_ZEROS");
    GEMM_INTERN(s_MAX_ROWS, "MAX_ROWS");
#undef GEMM_INTERN
    if (dtype_kw == NULL && (dtype_kw = Py_BuildValue("(s)", "dtype")) == NULL) return NULL;
    Py_RETURN_NONE;
}

/* 1 where ``t`` is exactly a torch.Tensor or a Parameter */
static int gemm_is_tensor(PyObject *t) {
    return Py_IS_TYPE(t, (PyTypeObject *)gemm_tensor) ||
           Py_IS_TYPE(t, (PyTypeObject *)gemm_param);
}

/* 1 where the attribute ``name`` of ``t`` is True, 0 where not, -1 on an error */
static int gemm_true_attr(PyObject *t, PyObject *name) {
    PyObject *v = PyObject_GetAttr(t, name);
    if (v == NULL) return -1;
    int r = v == Py_True;
    Py_DECREF(v);
    return r;
}

/* 1 where ``t`` is a float32 CPU tensor (and contiguous, with ``contiguous``); its shape
 * (a new reference) in *shape; 0 where not, -1 on an error */
static int gemm_plain(PyObject *t, int contiguous, PyObject **shape) {
    PyObject *dt = PyObject_GetAttr(t, s_dtype);
    if (dt == NULL) return -1;
    int ok = dt == gemm_f32;
    Py_DECREF(dt);
    if (ok) ok = gemm_true_attr(t, s_is_cpu);
    if (ok == 1 && contiguous) {
        PyObject *c = PyObject_CallMethodNoArgs(t, s_is_contiguous);
        if (c == NULL) return -1;
        ok = c == Py_True;
        Py_DECREF(c);
    }
    if (ok == 1) {
        *shape = PyObject_GetAttr(t, s_shape);
        if (*shape == NULL) return -1;
        if (!PyTuple_Check(*shape)) {
            Py_CLEAR(*shape);
            ok = 0;
        }
    }
    return ok;
}

/* the int item i of a shape tuple, -1 with an exception set on an error */
static long long gemm_dim(PyObject *shape, Py_ssize_t i) {
    return PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
}

/* an int entry of gemm's module dict */
static long long gemm_const(PyObject *name, int *ok) {
    PyObject *v = PyDict_GetItemWithError(gemm_mod, name);
    if (v == NULL || !PyLong_Check(v)) {
        *ok = 0;
        return 0;
    }
    long long r = PyLong_AsLongLong(v);
    if (r == -1 && PyErr_Occurred()) *ok = 0;
    return r;
}

static PyObject *gemm_call(PyObject *mod, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gemm_call(kind, x, W, c)");
        return NULL;
    }
    long kind = PyLong_AsLong(a[0]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    PyObject *x = a[1], *w = a[2], *c = a[3];
    if (kind < 0 || kind > 3 || gemm_mod == NULL || gomp_parallel == NULL ||
        !gemm_is_tensor(x) || !gemm_is_tensor(w) ||
        (c == Py_None ? kind >= 2 : !gemm_is_tensor(c)))
        Py_RETURN_NONE;
    PyObject *xs = NULL, *ws = NULL, *cs = NULL, *strides = NULL, *key = NULL, *out = NULL;
    PyObject *result = NULL;
    int ok;
    /* no autograd recording (the caller's Python path has the kernel's backward) */
    PyObject *on = PyObject_CallNoArgs(gemm_grad_on);
    if (on == NULL) return NULL;
    int grad_on = on == Py_True;
    Py_DECREF(on);
    for (int i = 0; grad_on && i < 3; i++) {
        PyObject *t = i == 0 ? x : (i == 1 ? w : c);
        if (t == Py_None) continue;
        int r = gemm_true_attr(t, s_requires_grad);
        if (r < 0) return NULL;
        if (r) Py_RETURN_NONE;
    }
    if ((ok = gemm_plain(x, 1, &xs)) != 1) goto done;
    if ((ok = gemm_plain(w, 0, &ws)) != 1) goto done;
    ok = 0;
    if (PyTuple_GET_SIZE(xs) != 2 || PyTuple_GET_SIZE(ws) != 2) goto done;
    long long m = gemm_dim(xs, 0), k = gemm_dim(xs, 1), n = gemm_dim(ws, 0);
    long long kw = gemm_dim(ws, 1);
    if (PyErr_Occurred()) goto fail;
    int limits = 1;
    long long max_rows = gemm_const(s_MAX_ROWS, &limits);
    if (PyErr_Occurred()) goto fail;
    if (!limits || k != kw || m <= 0 || k <= 0 || n <= 0 || m > max_rows) goto done;
    if ((strides = PyObject_CallMethodNoArgs(w, s_stride)) == NULL) goto fail;
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != 2) goto done;
    long long w_row = gemm_dim(strides, 0), w_col = gemm_dim(strides, 1);
    if (PyErr_Occurred()) goto fail;
    if (w_col != 1) goto done;
    long long c_rows = 0;
    if (c != Py_None) {
        if ((ok = gemm_plain(c, 1, &cs)) != 1) goto done;
        ok = 0;
        Py_ssize_t cd = PyTuple_GET_SIZE(cs);
        if (kind < 2) {  /* the bias: (N,) */
            if (cd != 1 || gemm_dim(cs, 0) != n) goto done;
            c_rows = 1;
        } else {  /* the addend: (rows, N) */
            if (cd != 2 || gemm_dim(cs, 0) != m || gemm_dim(cs, 1) != n) goto done;
            c_rows = m;
        }
        if (PyErr_Occurred()) goto fail;
    }
    /* the online choice's key, as ops.batched_linear & co make it */
    PyObject *threads_o = PyObject_CallNoArgs(gemm_threads);
    if (threads_o == NULL) goto fail;
    long threads = PyLong_AsLong(threads_o);
    if (threads == -1 && PyErr_Occurred()) {
        Py_DECREF(threads_o);
        goto fail;
    }
    long long bucket = 1;
    for (long long r = m - 1; r > 0; r >>= 1) bucket <<= 1;
    PyObject *bucket_o = PyLong_FromLongLong(bucket);
    if (bucket_o == NULL) {
        Py_DECREF(threads_o);
        goto fail;
    }
    PyObject *no_bias = c == Py_None ? Py_True : Py_False;
    if (kind == 0)
        key = PyTuple_Pack(6, gemm_kinds[0], bucket_o, ws, no_bias, threads_o, Py_False);
    else if (kind == 1)
        key = PyTuple_Pack(5, gemm_kinds[1], bucket_o, ws, no_bias, threads_o);
    else if (kind == 2)
        key = PyTuple_Pack(5, gemm_kinds[2], bucket_o, ws, threads_o, Py_False);
    else
        key = PyTuple_Pack(4, gemm_kinds[3], bucket_o, ws, threads_o);
    Py_DECREF(bucket_o);
    Py_DECREF(threads_o);
    if (key == NULL) goto fail;
    PyObject *decided = PyDict_GetItemWithError(gemm_ops, s_GEMM_DECIDED);
    if (decided == NULL || !PyDict_Check(decided)) {
        if (PyErr_Occurred()) goto fail;
        goto done;
    }
    PyObject *name = PyDict_GetItemWithError(decided, key);
    if (name == NULL) {
        if (PyErr_Occurred()) goto fail;
        goto done;  /* not decided yet: the trials, in Python */
    }
    int is_kernel = PyUnicode_Check(name) && PyUnicode_Compare(name, gemm_kernel_s) == 0;
    if (!is_kernel) {
        if (PyUnicode_Check(name) && PyUnicode_Compare(name, gemm_torch_s) == 0)
            result = Py_NewRef(gemm_torch_s);
        goto done;
    }
    limits = 1;
    long long entry = gemm_const(s_gparallel, &limits);
    long long work_min = gemm_const(s_PARALLEL_WORK, &limits);
    long long columns_below = gemm_const(s_COLUMNS_BELOW, &limits);
    if (PyErr_Occurred()) goto fail;
    if (!limits || entry == 0) goto done;
    /* the product (gemm._run) */
    PyObject *size = Py_BuildValue("(LL)", m, n);
    if (size == NULL) goto fail;
    PyObject *eargs[2] = {size, gemm_f32};
    out = PyObject_Vectorcall(gemm_empty, eargs, 1, dtype_kw);
    Py_DECREF(size);
    if (out == NULL) goto fail;
    long long block[16] = {0};  /* x, W, c (out where none: not read), out at 0, 1, 3, 5 */
    PyObject *ptr_of[4] = {x, w, c == Py_None ? out : c, out};
    static const int at[4] = {0, 1, 3, 5};
    for (int i = 0; i < 4; i++) {
        PyObject *p = PyObject_CallMethodNoArgs(ptr_of[i], s_data_ptr);
        if (p == NULL) goto fail;
        block[at[i]] = PyLong_AsLongLong(p);
        Py_DECREF(p);
        if (block[at[i]] == -1 && PyErr_Occurred()) goto fail;
    }
    block[2] = w_row;
    block[4] = c_rows;
    block[6] = m;
    block[7] = k;
    block[8] = n;
    block[9] = kind & 1;  /* its tanh */
    block[14] = omp_queries[0];
    block[15] = omp_queries[1];
    int split = -1;  /* over torch's threads: 1 by columns (rows of W), 0 by rows of x */
    if (threads > 1 && m * k * n >= work_min) {
        if (m < columns_below && n >= 16 * (long long)threads)
            split = 1;
        else if (m > 4)
            split = 0;
    }
    void (*run)(void *) = (void (*)(void *))(uintptr_t)entry;
    if (split < 0 && m * k * n < work_min) {  /* this thread alone: the entry's one part is
                                               * the whole product */
        run(block);
    } else if (split < 0) {  /* (one thread, a long product: the GIL released, as numba's
                              * nogil kernel did) */
        Py_BEGIN_ALLOW_THREADS
        run(block);
        Py_END_ALLOW_THREADS
    } else {
        block[10] = split;
        PyObject *cut = PyDict_GetItemWithError(gemm_mod, s_CUT_ZEROS);
        if (cut == NULL && PyErr_Occurred()) goto fail;
        int cut_on = cut != NULL ? PyObject_IsTrue(cut) : 0;
        if (cut_on < 0) goto fail;
        if (cut_on) {  /* rows ending in zeros cut where W is finite (gemm._finite) */
            PyObject *f = PyObject_CallOneArg(gemm_finite, w);
            if (f == NULL) goto fail;
            cut_on = PyObject_IsTrue(f);
            Py_DECREF(f);
            if (cut_on < 0) goto fail;
        }
        block[11] = cut_on;
        Py_BEGIN_ALLOW_THREADS
        gomp_parallel(run, block, (unsigned)threads, 0);
        Py_END_ALLOW_THREADS
    }
    result = out;
    out = NULL;
    goto done;
fail:
    ok = -1;
done:
    Py_XDECREF(xs);
    Py_XDECREF(ws);
    Py_XDECREF(cs);
    Py_XDECREF(strides);
    Py_XDECREF(key);
    Py_XDECREF(out);
    if (result == NULL && (ok < 0 || PyErr_Occurred())) return NULL;
    if (result == NULL) Py_RETURN_NONE;
    return result;
}

/* join_into(dst, stride, nodes, group, bases): executor._join's copies without its
 * columns: operand j of every node, for each position j of ``group`` in turn, copied
 * from its producer's buffer (by address, ``bases`` as copy_rows keeps it) into row i
 * of ``dst`` (rows ``stride`` bytes apart), the parts side by side. True, or False with
 * nothing copied where a source cannot be read by address. */
static PyObject *join_into(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 5 || !PyList_Check(a[2]) || !PyTuple_Check(a[3]) || !PyDict_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "join_into(dst, stride, nodes: list, group: tuple, bases: dict)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(a[1]);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    PyObject *nodes = a[2], *group = a[3], *bases = a[4];
    Py_ssize_t m = PyList_GET_SIZE(nodes), parts = PyTuple_GET_SIZE(group);
    if (m == 0 || parts == 0) Py_RETURN_TRUE;
    char **src = PyMem_Malloc((size_t)(m * parts) * sizeof(char *));
    Py_ssize_t *widths = PyMem_Malloc((size_t)parts * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (src == NULL || widths == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0; p < parts; p++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(group, p));
        if (j == -1 && PyErr_Occurred()) goto done;
        PyObject *t0 = operand_at(PyList_GET_ITEM(nodes, 0), j, "join_into");
        if (t0 == NULL) goto done;
        if (!IS_LAZY(t0) || !PyTuple_Check(((LazyObject *)t0)->shape)) {
            PyErr_SetString(PyExc_TypeError, "join_into: an operand without a shape");
            goto done;
        }
        PyObject *shape = ((LazyObject *)t0)->shape, *dtype = ((LazyObject *)t0)->dtype;
        Py_ssize_t numel = 1;
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
            Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
            if (k == -1 && PyErr_Occurred()) goto done;
            numel *= k;
        }
        Py_ssize_t itemsize;
        if (get_ssize(dtype, s_itemsize, &itemsize) < 0) goto done;
        widths[p] = numel * itemsize;
        int found = operand_pointers(nodes, j, bases, shape, dtype, widths[p], src + p * m,
                                     "join_into");
        if (found < 0) goto done;
        if (found == 0) {
            out = Py_NewRef(Py_False);
            goto done;
        }
    }
    Py_ssize_t offset = 0;
    for (Py_ssize_t p = 0; p < parts; p++) {
        char **from = src + p * m;
        for (Py_ssize_t i = 0; i < m; i++)
            memcpy(dst + i * stride + offset, from[i], (size_t)widths[p]);
        offset += widths[p];
    }
    out = Py_NewRef(Py_True);
done:
    PyMem_Free(src);
    PyMem_Free(widths);
    return out;
}

/* flat_into(dst, nodes, bases, nbytes, shape, dtype): every operand of every node of
 * ``nodes`` (computed LazyTensors of ``shape`` and ``dtype``, ``nbytes`` each), node by
 * node, copied by address to ``dst`` back to back: flat_column() and copy_rows() without
 * their lists of operands and slot ints (executor._run_ragged: DRNN's stack of 1,574
 * logits rows from 13 node batches, ~175 µs that way). True; False (a source that cannot
 * be read by address; nothing copied); None where the rows lie back to back in memory
 * already (nothing copied: the caller's gather takes a view of them); NULL with an
 * exception set. */
static PyObject *flat_into(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 6 || !PyList_Check(a[1]) || !PyDict_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "flat_into(dst, nodes: list, bases: dict, nbytes, shape, dtype)");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[3]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    PyObject *nodes = a[1], *bases = a[2], *shape = a[4], *dtype = a[5];
    Py_ssize_t m = PyList_GET_SIZE(nodes), total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *nd = PyList_GET_ITEM(nodes, i);
        PyObject *ins = IS_NODE(nd) ? ((NodeObject *)nd)->inputs : NULL;
        if (ins == NULL || !(PyList_CheckExact(ins) || PyTuple_CheckExact(ins))) {
            PyErr_SetString(PyExc_TypeError, "flat_into: a node without a list of operands");
            return NULL;
        }
        total += Py_SIZE(ins);
    }
    char **src = PyMem_Malloc((size_t)(total > 0 ? total : 1) * sizeof(char *));
    if (src == NULL) return PyErr_NoMemory();
    BaseCache cache = {{0}, {NULL}, 0, 0};
    PyObject *out = NULL;
    Py_ssize_t k = 0;
    int found = 1;
    for (Py_ssize_t i = 0; found == 1 && i < m; i++) {
        PyObject *ins = ((NodeObject *)PyList_GET_ITEM(nodes, i))->inputs;
        Py_ssize_t parts = Py_SIZE(ins);
        PyObject **items = PyList_CheckExact(ins) ? ((PyListObject *)ins)->ob_item
                                                  : ((PyTupleObject *)ins)->ob_item;
        for (Py_ssize_t j = 0; found == 1 && j < parts; j++, k++) {
            found = operand_pointer(items[j], &cache, bases, shape, dtype, nbytes, src + k,
                                    "flat_into");
            if (found < 0) goto done;
        }
    }
    if (found == 0) {
        out = Py_NewRef(Py_False);
        goto done;
    }
    int back_to_back = 1;
    for (Py_ssize_t i = 1; back_to_back && i < total; i++)
        back_to_back = src[i] == src[i - 1] + nbytes;
    if (back_to_back) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t i = 0; i < total; i++) memcpy(dst + i * nbytes, src[i], (size_t)nbytes);
    out = Py_NewRef(Py_True);
done:
    PyMem_Free(src);
    return out;
}

/* row_addresses(dst, slots, bases, nbytes, ts, shape, dtype): copy_rows without the
 * copy: the address of each row is written at ``dst`` (an int64 array of len(slots)),
 * for a kernel that reads the rows where they are (acrobat/rows.py). */
static PyObject *row_addresses(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (!rows_args(a, n, "row_addresses")) return NULL;
    char **dst = (char **)PyLong_AsVoidPtr(a[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[3]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    int found = row_pointers(a[1], a[2], a[4], a[5], a[6], nbytes, dst);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* rows_span(slots, bases, nbytes, ts, shape, dtype): the address of the first row of
 * ``slots`` (as copy_rows finds them) where every row lies right after the one before,
 * so that they are one span of memory (a loop's per-step outputs, views of one buffer,
 * read in the order it wrote them); else 0; False where a source cannot be read by
 * address. Nothing is copied. */
#define SPAN_CHUNK 32

static PyObject *rows_span(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 6 || !PyList_Check(a[0]) || !PyDict_Check(a[1]) || !PyList_Check(a[3]) ||
        PyList_GET_SIZE(a[3]) != PyList_GET_SIZE(a[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "rows_span(slots: list, bases: dict, nbytes, ts: list, shape, dtype)");
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(a[2]);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t m = PyList_GET_SIZE(a[0]);
    if (m == 0) return PyLong_FromLong(0);
    char **src = PyMem_Malloc((size_t)m * sizeof(char *));
    if (src == NULL) return PyErr_NoMemory();
    /* the addresses a chunk at a time, up to the first row not right after the one
     * before: rows from many sources (a batch of ragged stacks) stop at once */
    int found = 1;
    Py_ssize_t i = 1;  /* rows 0..i-1 lie back to back */
    for (Py_ssize_t start = 0; start < m && i >= start; start += SPAN_CHUNK) {
        Py_ssize_t count = m - start < SPAN_CHUNK ? m - start : SPAN_CHUNK;
        found = row_pointers_at(a[0], a[1], a[3], a[4], a[5], nbytes, src, start, count);
        if (found != 1) break;
        while (i < start + count && src[i] == src[i - 1] + nbytes) i++;
    }
    PyObject *result = NULL;
    if (found == 1) {
        result = i == m ? PyLong_FromVoidPtr(src[0]) : PyLong_FromLong(0);
    } else if (found == 0) {
        result = Py_NewRef(Py_False);
    }
    PyMem_Free(src);
    return result;
}

/* ---- batched GEMM over pointer lists --------------------------------------------- */

/* MKL's cblas_sgemm_batch / cblas_dgemm_batch, found by acrobat_kernels/blas.py in the
 * BLAS torch links (NULL: not there). Every integer MKL reads through a pointer is
 * stored here as 64 bits: on a little-endian machine the LP64 interface (32-bit ints)
 * reads the low half, which holds the same value, and the ILP64 one the whole. */
typedef void (*gemm_batch_fn)(int layout, const int *ta, const int *tb, const long long *m,
                              const long long *n, const long long *k, const void *alpha,
                              const void **a, const long long *lda, const void **b,
                              const long long *ldb, const void *beta, void **c,
                              const long long *ldc, long long groups, const long long *size);
static gemm_batch_fn gemm_batch_fns[2];

static PyObject *set_gemm_batch(PyObject *mod, PyObject *args) {
    unsigned long long s, d;
    if (!PyArg_ParseTuple(args, "KK", &s, &d)) return NULL;
    gemm_batch_fns[0] = (gemm_batch_fn)(uintptr_t)s;
    gemm_batch_fns[1] = (gemm_batch_fn)(uintptr_t)d;
    Py_RETURN_NONE;
}

/* Fill ptrs[i] = base + i * step, or copy the list at ``base`` where step == -1. */
static void fill_pointers(const void **ptrs, unsigned long long base, long long step,
                          long long count) {
    if (step == -1) {
        memcpy(ptrs, (const void *)(uintptr_t)base, (size_t)count * sizeof(void *));
        return;
    }
    for (long long i = 0; i < count; i++) ptrs[i] = (const char *)(uintptr_t)base + i * step;
}

/* gemm_batch(double, ta, tb, m, n, k, a, a_step, lda, b, b_step, ldb, beta, c, c_step,
 * ldc, count): C_i = op(A_i) @ op(B_i) + beta * C_i for i < count, row-major, one MKL
 * group. Each of a, b, c is a base address whose i-th matrix starts at base + i * step
 * bytes (step 0: one matrix for all), or with step -1 the address of count int64
 * addresses. ta, tb: 0 as stored, 1 transposed. */
static PyObject *gemm_batch(PyObject *mod, PyObject *args) {
    int dbl, ta, tb;
    long long m, nn, k, lda, ldb, ldc, a_step, b_step, c_step, count;
    unsigned long long a, b, c;
    double beta;
    if (!PyArg_ParseTuple(args, "pppLLLKLLKLLdKLLL", &dbl, &ta, &tb, &m, &nn, &k, &a, &a_step,
                          &lda, &b, &b_step, &ldb, &beta, &c, &c_step, &ldc, &count))
        return NULL;
    gemm_batch_fn fn = gemm_batch_fns[dbl];
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gemm_batch: no batched GEMM was found");
        return NULL;
    }
    if (count <= 0) Py_RETURN_NONE;
    const void **ptrs = PyMem_Malloc((size_t)(3 * count) * sizeof(void *));
    if (ptrs == NULL) return PyErr_NoMemory();
    fill_pointers(ptrs, a, a_step, count);
    fill_pointers(ptrs + count, b, b_step, count);
    fill_pointers(ptrs + 2 * count, c, c_step, count);
    int tra = ta ? 112 : 111, trb = tb ? 112 : 111; /* CblasTrans, CblasNoTrans */
    float alpha_s = 1.0f, beta_s = (float)beta;
    double alpha_d = 1.0;
    const void *alpha = dbl ? (const void *)&alpha_d : (const void *)&alpha_s;
    const void *beta_p = dbl ? (const void *)&beta : (const void *)&beta_s;
    Py_BEGIN_ALLOW_THREADS
    fn(101 /* CblasRowMajor */, &tra, &trb, &m, &nn, &k, alpha, ptrs, &lda, ptrs + count,
       &ldb, beta_p, (void **)(ptrs + 2 * count), &ldc, 1, &count);
    Py_END_ALLOW_THREADS
    PyMem_Free(ptrs);
    Py_RETURN_NONE;
}

/* ---- module ---------------------------------------------------------------------- */

/* stack_mark(): an address on the C stack of the caller's interpreter frame. Fibers run
 * on pooled greenlets whose stacks begin where the driver stood when each was started;
 * an unwinder (a C++ error's backtrace) walks from a fiber into the driver's frames
 * there, which are only sound while the driver switches from that same place. */
static PyObject *stack_mark(PyObject *mod, PyObject *unused) {
    volatile char here = 0;
    return PyLong_FromVoidPtr((void *)&here);
}

/* module_state(m, hooks, plain): the state of the module tree under ``m`` that a block's
 * trace depends on (block._module_state), flat: per module, depth first (m.modules()'s
 * order), its id, its ``training`` flag, the count and the ids of its own parameters,
 * likewise of its buffers, per hook dict named in ``hooks`` the count and the keys (the
 * handles' ids), and the count and (name, value) pairs of its attributes whose value's
 * type is in ``plain`` (names not starting with "_"). Equal tuples: the same state. */
static PyObject *module_state(PyObject *mod, PyObject *const *a, Py_ssize_t n) {
    if (n != 3 || !PyTuple_Check(a[1]) || !PyTuple_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "module_state(m, hooks, plain)");
        return NULL;
    }
    PyObject *hooks = a[1], *plain = a[2];
    PyObject *out = PyList_New(0), *todo = PyList_New(0), *seen = PySet_New(NULL);
    PyObject *result = NULL;
    if (out == NULL || todo == NULL || seen == NULL || PyList_Append(todo, a[0]) < 0)
        goto done;
    while (PyList_GET_SIZE(todo) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(todo) - 1;
        PyObject *m = PyList_GET_ITEM(todo, last);
        Py_INCREF(m);
        if (PyList_SetSlice(todo, last, last + 1, NULL) < 0) { Py_DECREF(m); goto done; }
        PyObject *key = PyLong_FromVoidPtr(m);
        int found = key == NULL ? -1 : PySet_Contains(seen, key);
        if (found != 0 || PySet_Add(seen, key) < 0) {
            Py_XDECREF(key);
            Py_DECREF(m);
            if (found == 1) continue;
            goto done;
        }
        PyObject *d = PyObject_GenericGetDict(m, NULL);
        Py_DECREF(m);
        if (d == NULL || !PyDict_Check(d)) {
            Py_DECREF(key);
            Py_XDECREF(d);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a module without a __dict__");
            goto done;
        }
        int bad = PyList_Append(out, key) < 0;
        Py_DECREF(key);
        PyObject *training = PyDict_GetItemString(d, "training");  /* borrowed */
        bad = bad || PyList_Append(out, training != NULL ? training : Py_None) < 0;
        static const char *tables[] = {"_parameters", "_buffers"};
        for (int k = 0; k < 2 && !bad; k++) {
            PyObject *table = PyDict_GetItemString(d, tables[k]);
            Py_ssize_t count = table != NULL && PyDict_Check(table) ? PyDict_GET_SIZE(table) : 0;
            PyObject *c = PyLong_FromSsize_t(count);
            bad = c == NULL || PyList_Append(out, c) < 0;
            Py_XDECREF(c);
            PyObject *k_, *v;
            Py_ssize_t pos = 0;
            while (!bad && count > 0 && PyDict_Next(table, &pos, &k_, &v)) {
                PyObject *id = PyLong_FromVoidPtr(v);
                bad = id == NULL || PyList_Append(out, id) < 0;
                Py_XDECREF(id);
            }
        }
        for (Py_ssize_t h = 0; h < PyTuple_GET_SIZE(hooks) && !bad; h++) {
            PyObject *table = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(hooks, h));
            Py_ssize_t count = table != NULL && PyDict_Check(table) ? PyDict_GET_SIZE(table) : 0;
            PyObject *c = PyLong_FromSsize_t(count);
            bad = c == NULL || PyList_Append(out, c) < 0;
            Py_XDECREF(c);
            PyObject *k_, *v;
            Py_ssize_t pos = 0;
            while (!bad && count > 0 && PyDict_Next(table, &pos, &k_, &v))
                bad = PyList_Append(out, k_) < 0;
        }
        Py_ssize_t at = PyList_GET_SIZE(out), count = 0;
        bad = bad || PyList_Append(out, Py_None) < 0;  /* the count, set below */
        PyObject *k_, *v;
        Py_ssize_t pos = 0;
        while (!bad && PyDict_Next(d, &pos, &k_, &v)) {
            if (!PyUnicode_Check(k_) || PyUnicode_GET_LENGTH(k_) == 0 ||
                PyUnicode_READ_CHAR(k_, 0) == '_')
                continue;
            int is_plain = 0;
            for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(plain); t++)
                if ((PyObject *)Py_TYPE(v) == PyTuple_GET_ITEM(plain, t)) { is_plain = 1; break; }
            if (!is_plain) continue;
            bad = PyList_Append(out, k_) < 0 || PyList_Append(out, v) < 0;
            count++;
        }
        if (!bad) {
            PyObject *c = PyLong_FromSsize_t(count);
            if (c == NULL) bad = 1;
            else PyList_SetItem(out, at, c);  /* steals c */
        }
        PyObject *children = bad ? NULL : PyDict_GetItemString(d, "_modules");
        if (children != NULL && PyDict_Check(children) && PyDict_GET_SIZE(children) > 0) {
            PyObject *vals = PyDict_Values(children);
            if (vals == NULL) bad = 1;
            for (Py_ssize_t i = vals == NULL ? 0 : PyList_GET_SIZE(vals) - 1; i >= 0 && !bad; i--) {
                PyObject *c = PyList_GET_ITEM(vals, i);
                if (c != Py_None) bad = PyList_Append(todo, c) < 0;
            }
            Py_XDECREF(vals);
        }
        Py_DECREF(d);
        if (bad || PyErr_Occurred()) goto done;
    }
    result = PyList_AsTuple(out);
done:
    Py_XDECREF(out);
    Py_XDECREF(todo);
    Py_XDECREF(seen);
    return result;
}

static PyMethodDef methods[] = {
    {"module_state", (PyCFunction)(void (*)(void))module_state, METH_FASTCALL,
     "module_state(m, hooks, plain): the flat state of m's module tree (block._module_state)"},
    {"stack_mark", (PyCFunction)stack_mark, METH_NOARGS,
     "stack_mark(): an address on the caller's C stack (fibers' worker pools)"},
    {"setup", (PyCFunction)setup, METH_VARARGS,
     "setup(Node, LazyTensor, check_inputs, config, type_key)"},
    {"add_node", (PyCFunction)(void (*)(void))add_node, METH_FASTCALL,
     "add_node(rt, op, func, args, kwargs, inputs, info, sig) -> Node (graph.add_node)"},
    {"record_node", (PyCFunction)(void (*)(void))record_node, METH_FASTCALL,
     "record_node(rt, op, func, args, kwargs) -> outputs (graph.record's tail)"},
    {"has_lazy", (PyCFunction)has_lazy, METH_O,
     "has_lazy(a) -> whether a LazyTensor is in a (tuples, lists, dicts, slices)"},
    {"lookup_rows", (PyCFunction)(void (*)(void))lookup_rows, METH_FASTCALL,
     "lookup_rows(nodes, size) -> the torch.tensor(i) index of each node's first input, "
     "or None"},
    {"element_repeats", (PyCFunction)(void (*)(void))element_repeats, METH_FASTCALL,
     "element_repeats(column, op) -> (first position of each distinct int the loop "
     "elements were made from, each element's index into those), or None"},
    {"place_rows", (PyCFunction)(void (*)(void))place_rows, METH_FASTCALL,
     "place_rows(nodes, rows, base): row rows[i] and slot base + rows[i] of each node"},
    {"heights", (PyCFunction)heights, METH_O,
     "heights(batches): scheduler.relevel's longest-path pass"},
    {"relift", (PyCFunction)(void (*)(void))relift, METH_FASTCALL,
     "relift(nodes, op, sig, info, consts): scheduler._join's rewrite of lifted nodes"},
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL,
     "copy_rows(dst, slots, bases, nbytes, ts, shape, dtype) -> True, or False (a source "
     "that cannot be read by address; nothing copied)"},
    {"pad_rows", (PyCFunction)(void (*)(void))pad_rows, METH_FASTCALL,
     "pad_rows(dst, stride, rows, slots, bases, nbytes, ts, shape, dtype[, parts, inner]): rows copied by address to dst + row * stride"},
    {"pad_parts", (PyCFunction)(void (*)(void))pad_parts, METH_FASTCALL,
     "pad_parts(dst, stride, slots, bases, ts, dtype, counts, shapes, nbytes) -> True, or "
     "False (a ragged argument's parts by address to the start of their rows)"},
    {"pick_rows", (PyCFunction)(void (*)(void))pick_rows, METH_FASTCALL,
     "pick_rows(dst, rowbytes, slots, bases, ts, dtype, shapes, nbytes, offsets) -> True, or "
     "False (one row of each value, values of any leading sizes, by address)"},
    {"unpad_parts", (PyCFunction)(void (*)(void))unpad_parts, METH_FASTCALL,
     "unpad_parts(src, stride, dst, counts, nbytes): each padded row's first nbytes of its "
     "part, back to back at dst"},
    {"setup_omp", (PyCFunction)setup_omp, METH_VARARGS,
     "setup_omp(GOMP_parallel, omp_get_thread_num, omp_get_num_threads): their addresses"},
    {"omp_run", (PyCFunction)(void (*)(void))omp_run, METH_FASTCALL,
     "omp_run(entry, threads, *ints): parallel.run in C (a numba cfunc on torch's team)"},
    {"setup_materialize", (PyCFunction)setup_materialize, METH_VARARGS,
     "setup_materialize(miss, plain types, torch.Tensor, graph.GradTag)"},
    {"materialize", (PyCFunction)materialize, METH_O,
     "materialize(value) -> fibers._materialize's common cases, or the miss sentinel"},
    {"setup_gemm", (PyCFunction)setup_gemm, METH_VARARGS,
     "setup_gemm(ops dict, gemm dict, _finite, torch.empty, get_num_threads, "
     "is_grad_enabled, float32, Tensor, Parameter)"},
    {"gemm_call", (PyCFunction)(void (*)(void))gemm_call, METH_FASTCALL,
     "gemm_call(kind, x, W, c) -> the product by the kernel, \"torch\" (the choice took "
     "torch's GEMM) or None (the Python path decides)"},
    {"flat_into", (PyCFunction)(void (*)(void))flat_into, METH_FASTCALL,
     "flat_into(dst, nodes, bases, nbytes, shape, dtype) -> True, False (a source that "
     "cannot be read by address) or None (the rows back to back already); nothing copied "
     "but for True"},
    {"join_into", (PyCFunction)(void (*)(void))join_into, METH_FASTCALL,
     "join_into(dst, stride, nodes, group, bases) -> True, or False (executor._join's "
     "copies: operand j of every node for each j of group, side by side in each row)"},
    {"rows_span", (PyCFunction)(void (*)(void))rows_span, METH_FASTCALL,
     "rows_span(slots, bases, nbytes, ts, shape, dtype) -> the first row's address where "
     "the rows lie back to back in memory, else 0; False (a source that cannot be read "
     "by address)"},
    {"row_addresses", (PyCFunction)(void (*)(void))row_addresses, METH_FASTCALL,
     "row_addresses(dst, slots, bases, nbytes, ts, shape, dtype) -> True, or False (as "
     "copy_rows, writing each row's address at dst instead of copying it)"},
    {"set_gemm_batch", (PyCFunction)set_gemm_batch, METH_VARARGS,
     "set_gemm_batch(sgemm_batch_address, dgemm_batch_address): MKL's batched GEMMs"},
    {"gemm_batch", (PyCFunction)gemm_batch, METH_VARARGS,
     "gemm_batch(double, ta, tb, m, n, k, a, a_step, lda, b, b_step, ldb, beta, c, c_step, "
     "ldc, count): C_i = op(A_i) op(B_i) + beta C_i over pointer lists"},
    {"record_data", (PyCFunction)(void (*)(void))record_data, METH_FASTCALL,
     "record_data(rt, op, sig, data, shape, dtype, deferred) -> LazyTensor | None"},
    {"resume_all", (PyCFunction)(void (*)(void))resume_all, METH_FASTCALL,
     "resume_all(blocked, ready): the fibers a flush unblocked made ready"},
    {"fork", (PyCFunction)(void (*)(void))native_fork, METH_FASTCALL | METH_KEYWORDS,
     "fork(fn, *args, **kwargs) -> Future\n\nStart ``fn(*args, **kwargs)`` as a child fiber "
     "of the running instance: inside ``f.map`` the child runs concurrently with its parent "
     "and siblings, each blocking on its own tensor values while the others record; "
     "``result()`` joins. Outside ``f.map`` (eager) it calls ``fn``. (fibers.fork, its "
     "common case in C.)"},
    {"setup_fork", (PyCFunction)setup_fork, METH_VARARGS, "setup_fork(Fiber, Future, fork)"},
    {"setup_factory", setup_factory, METH_O, "setup_factory(ops.factory_call)"},
    {"factory_call", (PyCFunction)(void (*)(void))native_factory_call, METH_FASTCALL,
     "factory_call(func, size): ops.factory_call's cache hit in C"},
    {"worker_loop", (PyCFunction)(void (*)(void))worker_loop, METH_FASTCALL,
     "worker_loop(me, pool, box) -> None: a worker greenlet's loop (fibers._worker)"},
    {"fiber_main", (PyCFunction)(void (*)(void))fiber_main, METH_FASTCALL,
     "fiber_main(rt, fiber): fibers._fiber_main in C"},
    {"setup_fiber_main", (PyCFunction)setup_fiber_main, METH_VARARGS,
     "setup_fiber_main(wrap_args, end_grad)"},
    {"flat_column", (PyCFunction)flat_column, METH_O,
     "flat_column(nodes) -> (operands, slots): every operand of every node"},
    {"column", (PyCFunction)(void (*)(void))column, METH_FASTCALL,
     "column(nodes, j) -> (operand j of each node, their slots)"},
    {"lazy_range", (PyCFunction)(void (*)(void))lazy_range, METH_FASTCALL,
     "lazy_range(node, start, stop, step, shape, dtype, key) -> [LazyTensor per index]"},
    {"scan_column", (PyCFunction)(void (*)(void))scan_column, METH_FASTCALL,
     "scan_column(nodes, first, width, j, active) -> (sequence j's elements step-major, slots)"},
    {"fast_dealloc", fast_dealloc, METH_O,
     "fast_dealloc(cls): a method-only subclass of NodeBase or LazyBase freed in one pass"},
    {"release_inputs", release_inputs, METH_O,
     "release_inputs(batches): computed nodes let go of their operands"},
    {"pin", pin_outputs, METH_O, "pin(node): its batch's outputs are never released early"},
    {"keep_freed", keep_freed, METH_O,
     "keep_freed(list or None): released outputs appended to the list (config.VERIFY)"},
    {"out_counts", out_counts, METH_O,
     "out_counts(node): (handles per output, the batch's live counts or None, pinned)"},
    {"finish_rows", (PyCFunction)(void (*)(void))finish_rows, METH_FASTCALL,
     "finish_rows(nodes, outs, base): outs, row and slot of each node of a batch"},
    {"setup_record", (PyCFunction)setup_record, METH_VARARGS,
     "setup_record(freeze, freeze_kwargs, infer, wrap_outputs)"},
    {"trace_hit", (PyCFunction)(void (*)(void))trace_hit, METH_FASTCALL,
     "trace_hit(block, args, rt) -> (trace, inputs) of a cache hit, or None"},
    {"setup_values", (PyCFunction)setup_values, METH_VARARGS,
     "setup_values(TENSOR, torch.Size([]), torch.int64, torch.Size, torch.get_default_dtype)"},
    {"setup_scans", (PyCFunction)setup_scans, METH_VARARGS,
     "setup_scans(acrobat.config, acrobat.executor): modules ScanBase's call reads"},
    {"setup_calls", (PyCFunction)setup_calls, METH_VARARGS,
     "setup_calls(acrobat.graph, acrobat.analysis, torch): modules the call slots read"},
    {"value_read", (PyCFunction)value_read, METH_O,
     "value_read(t) -> t.tolist() (fibers.demand_py, its common path in C)"},
    {"setup_fibers", (PyCFunction)setup_fibers, METH_VARARGS,
     "setup_fibers(demand_py, host_list, torch._C._is_torch_function_enabled)"},
    {"memo_entries", (PyCFunction)memo_entries, METH_O,
     "memo_entries(block): how many cache hits the block remembers"},
    {"clear_memos", (PyCFunction)clear_memos, METH_O,
     "clear_memos(blocks): drop the blocks' remembered cache hits (a map ended)"},
    {"switch_away", (PyCFunction)py_switch_away, METH_O,
     "switch_away(rt): fibers.switch_away in C"},
    {"unneeded", (PyCFunction)unneeded, METH_O,
     "unneeded(batches) -> indices of the batches whose nodes nothing recorded reads and "
     "no fiber waits for (scheduler.unneeded)"},
    {"prune_dead", (PyCFunction)prune_dead, METH_O,
     "prune_dead(batches) -> how many nodes nothing could read were dropped "
     "(scheduler.prune_dead)"},
    {"setup_shortcuts", (PyCFunction)setup_shortcuts, METH_O,
     "setup_shortcuts(graph.record)"},
    {"setup_block", (PyCFunction)setup_block, METH_VARARGS,
     "setup_block(_key, _finish_call, split_call, _MISS)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "acrobat._native",
                                    "The record hot path in C (see _native.c).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NodeType) < 0 || PyType_Ready(&LazyType) < 0 ||
        PyType_Ready(&BlockBaseType) < 0 || PyType_Ready(&AutoBaseType) < 0 ||
        PyType_Ready(&RegionBaseType) < 0 || PyType_Ready(&ShortcutType) < 0 ||
        PyType_Ready(&ScanBaseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(s_device, "device");
    INTERN(s_type, "type");
    INTERN(s_cpu, "cpu");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_itemsize, "itemsize");
    INTERN(s_fiber, "fiber");
    INTERN(s_phase, "phase");
    INTERN(s_instance, "instance");
    INTERN(s_grad, "grad");
    INTERN(s_hoisted, "hoisted");
    INTERN(s_fresh, "fresh");
    INTERN(s_grad_resume, "grad_resume");
    INTERN(s_buckets, "buckets");
    INTERN(s_nodes, "nodes");
    INTERN(s_ALIGN_WINDOW, "ALIGN_WINDOW");
    INTERN(s_metas, "metas");
    INTERN(s_keys, "keys");
    INTERN(s_single, "single");
    INTERN(s_sig_info, "sig_info");
    INTERN(s_deferred, "deferred");
    INTERN(s_cache, "cache");
    INTERN(s_factory_keys, "factory_keys");
    INTERN(s_id, "id");
    INTERN(s_run_id, "run_id");
    INTERN(s_may_split, "may_split");
    INTERN(s_op, "op");
    INTERN(s_info, "info");
    INTERN(s_out_spec, "out_spec");
    INTERN(s_leaf, "leaf");
    INTERN(s_sig, "sig");
    INTERN(s_split_on, "split_on");
    INTERN(s_splits, "splits");
    INTERN(s_memo, "memo");
    INTERN(s_arg_pos, "arg_pos");
    INTERN(s_var, "var");
    INTERN(s_struct, "struct");
    INTERN(s_plain_tuple, "plain_tuple");
    INTERN(s_call_fast, "call_fast");
    INTERN(s_RT, "RT");
    INTERN(s_tracer, "tracer");
    INTERN(s_thread, "thread");
    INTERN(s_disabled, "disabled");
    INTERN(s_values, "values");
    INTERN(s_block, "block");
    INTERN(s_call, "_call");
    INTERN(s_tensor_args, "tensor_args");
    INTERN(s_index_args, "index_args");
    INTERN(s_state_args, "state_args");
    INTERN(s_code_like, "code_like");
    INTERN(s_hits, "hits");
    INTERN(s_region_call, "_region_call");
    INTERN(s_region_block, "_region_block");
    INTERN(s_value_data, "value_data");
    INTERN(s_value_block, "value_block");
    INTERN(s_value_call, "_value_call");
    INTERN(s_VALUE_PARAMS, "VALUE_PARAMS");
    INTERN(s_scalar_data, "scalar_data");
    INTERN(s_tensor, "tensor");
    INTERN(s_blocked, "blocked");
    INTERN(s_all_fibers, "all_fibers");
    INTERN(s_live, "live");
    INTERN(s_append, "append");
    INTERN(s_nest, "nest");
    INTERN(s_fn, "fn");
    INTERN(s_FIBER_POOL, "FIBER_POOL");
    INTERN(s_appendleft, "appendleft");
    INTERN(s_ready, "ready");
    INTERN(s_failed, "failed");
    INTERN(s_glet, "glet");
    INTERN(s_task, "task");
    INTERN(s_value, "value");
    INTERN(s_error, "error");
    INTERN(s_done, "done");
    INTERN(s_joiners, "joiners");
    INTERN(s_extend, "extend");
    INTERN(s_popleft, "popleft");
    INTERN(s_pool, "pool");
    INTERN(s_memo_blocks, "memo_blocks");
    INTERN(s_main, "main");
    INTERN(s_parent, "parent");
    INTERN(s_waiting, "waiting");
    INTERN(s_host, "host");
    INTERN(s_switch, "switch");
    INTERN(s_py_rows, "py_rows");
    INTERN(s_counted, "counted");
    INTERN(s_sequences, "sequences");
    INTERN(s_carried, "carried");
    INTERN(s_reverse, "reverse");
    INTERN(s_step, "step");
    INTERN(s_scan, "scan");
    INTERN(s_record, "record");
    INTERN(s_scan_call, "_scan_call");
    INTERN(s_run_traces, "run_traces");
    INTERN(s_AUTO_SCANS, "AUTO_SCANS");
    INTERN(s_CONSTANT_STATES, "CONSTANT_STATES");
    INTERN(s_BLOCK_CACHE_SIZE, "BLOCK_CACHE_SIZE");
    INTERN(s_constant, "constant");
#undef INTERN
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    Py_INCREF(&NodeType);
    if (PyModule_AddObject(m, "NodeBase", (PyObject *)&NodeType) < 0) return NULL;
    Py_INCREF(&LazyType);
    if (PyModule_AddObject(m, "LazyBase", (PyObject *)&LazyType) < 0) return NULL;
    Py_INCREF(&BlockBaseType);
    if (PyModule_AddObject(m, "BlockBase", (PyObject *)&BlockBaseType) < 0) return NULL;
    Py_INCREF(&AutoBaseType);
    if (PyModule_AddObject(m, "AutoBase", (PyObject *)&AutoBaseType) < 0) return NULL;
    Py_INCREF(&RegionBaseType);
    if (PyModule_AddObject(m, "RegionBase", (PyObject *)&RegionBaseType) < 0) return NULL;
    Py_INCREF(&ShortcutType);
    if (PyModule_AddObject(m, "Shortcut", (PyObject *)&ShortcutType) < 0) return NULL;
    Py_INCREF(&ScanBaseType);
    if (PyModule_AddObject(m, "ScanBase", (PyObject *)&ScanBaseType) < 0) return NULL;
    return m;
}

"""BatchNorm under DDP: a model called twice before one backward while DDP
broadcasts its buffers (ddp-broadcast-buffers-inplace), and plain BatchNorm
over a per-GPU batch of a few samples (batchnorm-not-synced).

With broadcast_buffers=True (the default) DDP copies rank 0's buffers into
every rank's at the start of each forward. BatchNorm's backward keeps its
running statistics, and autograd checks their version counter: the second
forward's in-place copy moves it, and backward fails with "one of the
variables needed for gradient computation has been modified by an inplace
operation". GANs (the discriminator on real, then on fake) and two-view
contrastive training do exactly this. PyTorch releases built after
pytorch/pytorch#175851 (merged in February 2026) preserve the counters during
the copy, so the same code trains there; older ones fail, and the finding says
so.

Read only where the file shows it all: the wrapped model builds a BatchNorm
(in one of the file's classes or functions, or a torchvision model made of
them), DDP is not told broadcast_buffers=False, no SyncBatchNorm conversion,
and two calls of the wrapper in one function, the first kept for backward
(outside no_grad, not detached), with no backward between them and one after.

Plain BatchNorm normalises each GPU's share of the batch alone. Segmentation,
detection and 3D models train with two to four samples per GPU, where those
statistics are noise, and their recipes convert to SyncBatchNorm; a file that
shows a BatchNorm model under DDP, a training DataLoader of at most
SMALL_PER_GPU_BATCH samples (a literal, or an argparse default), and no
SyncBatchNorm anywhere (not even behind a flag) is reported.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator

from assistant.lint.checks.unused import inside_no_grad, wrapped_by
from assistant.lint.model import (
    Script,
    children,
    full_text,
    keyword,
    position,
    short,
    source_text,
    walk,
)
from assistant.lint.ranks import assignments_seen_from
from assistant.lint.registry import check
from assistant.lint.torchapi import (
    LIGHTNING_PACKAGES,
    backend_of,
    framework_processes,
    init_calls,
    is_backward,
    is_ddp,
    lightning_classes,
)
from assistant.lint.values import resolved_int
from assistant.results import Finding

# torch's BatchNorm layers and the libraries' own, which keep running statistics
# the same way (MinkowskiEngine's MinkowskiBatchNorm, timm's BatchNormAct2d, PyG's
# BatchNorm); not the synchronised ones (SyncBatchNorm, MinkowskiSyncBatchNorm,
# detectron2's NaiveSyncBatchNorm) nor the frozen ones, whose statistics never move.
BATCH_NORM = re.compile(r"^(?!\w*(Sync|Frozen))\w*BatchNorm(Act)?([123]d)?$")
# torchvision's models built of BatchNorm layers (convnext and the ViTs use LayerNorm).
TORCHVISION_BN_MODELS = re.compile(
    r"^(resnet|resnext|wide_resnet|densenet|mobilenet|efficientnet|regnet|vgg\d+_bn|"
    r"inception|googlenet|shufflenet|mnasnet|deeplabv3|fcn_|lraspp)"
)
SYNC_CONVERSION = "convert_sync_batchnorm"
# Where a file may turn synchronised BatchNorm on: torch's class and converter,
# mmcv's norm_cfg type, Lightning's Trainer flag.
SYNC_NAMES = frozenset({"SyncBatchNorm", SYNC_CONVERSION, "sync_batchnorm"})
SYNC_STRINGS = frozenset({"SyncBN", "SyncBatchNorm"})
# A keyword that picks a builder's normalisation: MONAI's norm=Norm.BATCH,
# torchvision's norm_layer=nn.BatchNorm2d, mmcv's norm_cfg=dict(type="BN").
NORM_KEYWORDS = frozenset({"norm", "norm_layer", "norm_type", "norm_cfg"})
BATCH_NORM_SETTING = re.compile(r"batch|['\"]BN['\"]", re.IGNORECASE)
# A norm whose statistics every rank keeps alike without a collective: synchronised,
# or frozen (torchvision.ops.FrozenBatchNorm2d, as DETR's backbone is built).
UNMOVING_NORM = re.compile(r"sync|frozen", re.IGNORECASE)
# Samples per GPU at which BatchNorm's statistics are noise (segmentation and 3D
# recipes train with 2-4 per GPU and convert to SyncBatchNorm).
SMALL_PER_GPU_BATCH = 4
EVALUATION_LOADER = re.compile(r"val|test|eval|dev", re.IGNORECASE)
# How many of the file's classes and functions the model's build is followed through.
MAX_BUILDERS = 64


@check("ddp-broadcast-buffers-inplace")
def check_batchnorm_model_called_twice_before_backward(script: Script) -> Iterator[Finding]:
    """`d_real = D(real); d_fake = D(fake); loss.backward()` with D a DDP over
    BatchNorm layers and broadcast_buffers left at True."""
    if SYNC_CONVERSION in script.called_short_names:
        return
    for ddp in (node for node, name in script.call_names if is_ddp(name)):
        if not broadcasts_buffers(ddp):
            continue
        names = wrapper_names(script, ddp)
        norm = batch_norm_built(script, ddp, wrapped_by(script, ddp, set())[0])
        if norm is None:
            continue
        for scope in script.all_scopes:
            for first, second in second_calls_before_backward(script, scope, names):
                yield script.finding(
                    "ddp-broadcast-buffers-inplace",
                    second,
                    f"{source_text(second.func)}() runs again (line {first.lineno} ran it) before "
                    f"backward; it is DDP (line {ddp.lineno}) over BatchNorm (line {norm}) with "
                    "broadcast_buffers=True, so each forward copies rank 0's running statistics "
                    "in place and, on PyTorch older than the 2026 fix (pytorch/pytorch#175851), "
                    'backward fails with "modified by an inplace operation": pass '
                    "broadcast_buffers=False (with SyncBatchNorm to keep the statistics "
                    "in step), or run both inputs in one call (torch.cat)",
                )


@check("batchnorm-not-synced")
def check_batchnorm_over_a_few_samples_per_gpu(script: Script) -> Iterator[Finding]:
    """`model = DDP(deeplabv3_resnet101())` trained by a DataLoader of
    `--batch_size` default 2, with no SyncBatchNorm in the file."""
    if may_sync_batchnorm(script):
        return
    loaders = small_training_loaders(script)
    if not loaders:
        yield from contrastive_without_sync(script)
        return
    if keeps_batch_norm_in_eval_mode(script):
        return
    loader, size, shared = loaders[0]
    wrapped = ddp_over_plain_batchnorm(script)
    if wrapped is None:
        yield from lightning_trainers_without_sync(script, loader, size)
        return
    ddp, norm = wrapped
    samples = (
        f"at most {size} samples per process, a global batch of {shared} divided over two or more,"
        if shared
        else f"{size} sample{'s' if size != 1 else ''} per process"
    )
    yield script.finding(
        "batchnorm-not-synced",
        ddp,
        f"DDP wraps a model with plain BatchNorm (line {norm}) trained on {samples} "
        f"(the DataLoader on line "
        f"{loader.lineno}): each GPU's BatchNorm normalises over those alone, so its "
        "statistics are noise and the model trains worse than one GPU with the same "
        "global batch; convert it before DDP: "
        "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    )


def keeps_batch_norm_in_eval_mode(script: Script) -> bool:
    """The file puts its BatchNorm layers in eval mode while the model trains
    (`for m in self.backbone.modules(): if isinstance(m, nn.BatchNorm2d): m.eval()`,
    mmdet's norm_eval): they normalise with their running statistics, not the
    batch's, so how few samples a GPU holds does not move them."""
    for node in script.nodes:
        if not (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Call)
            and script.name_of(node.test.func) == "isinstance"
            and len(node.test.args) == 2
            and isinstance(node.test.args[0], ast.Name)
        ):
            continue
        kinds = node.test.args[1]
        named = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
        if not any("BatchNorm" in short(source_text(kind)) for kind in named):
            continue
        layer = node.test.args[0].id
        if any(
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "eval"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == layer
            for statement in node.body
            for call in walk(statement)
        ):
            return True
    return False


def ddp_over_plain_batchnorm(script: Script) -> tuple[ast.Call, int] | None:
    """The first DDP call of the file whose model builds plain BatchNorm, and that line."""
    for ddp in (node for node, name in script.call_names if is_ddp(name)):
        norm = batch_norm_built(script, ddp, wrapped_by(script, ddp, set())[0])
        if norm is not None:
            return ddp, norm
    return None


def contrastive_without_sync(script: Script) -> Iterator[Finding]:
    """A loss over embeddings gathered from every rank with autograd (SimCLR's
    NT-Xent, CLIP's InfoNCE: torch.distributed.nn's all_gather, or a file's own
    autograd Function that all_gathers) computed by a DDP model with plain
    BatchNorm: each GPU's BatchNorm statistics tell its own samples apart, a
    shortcut the contrastive loss learns (SimCLR and BYOL use global BN)."""
    gather = gradient_gather(script)
    wrapped = ddp_over_plain_batchnorm(script) if gather is not None else None
    if wrapped is not None:
        ddp, norm = wrapped
        yield script.finding(
            "batchnorm-not-synced",
            ddp,
            f"DDP wraps a model with plain BatchNorm (line {norm}) whose outputs enter a "
            f"loss over every rank's batch (the all_gather on line {gather.lineno}): each "
            "GPU's BatchNorm normalises its own samples alone, and a contrastive loss learns "
            "from those per-GPU statistics instead of the images (SimCLR and BYOL train with "
            "global BatchNorm); convert it before DDP: "
            "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)",
        )


def gradient_gather(script: Script) -> ast.Call | None:
    """An all_gather gradients flow back through: torch.distributed.nn's, or one
    inside a file's own torch.autograd.Function (SimCLR's GatherLayer)."""
    for node, name in script.call_names:
        if short(name) == "all_gather" and name.startswith("torch.distributed.nn"):
            return node
    for cls in script.of_type(ast.ClassDef):
        if not any(short(script.name_of(base)) == "Function" for base in cls.bases):
            continue
        for node in walk(cls):
            if isinstance(node, ast.Call) and short(script.name_of(node.func)) == "all_gather":
                return node
    return None


def lightning_trainers_without_sync(
    script: Script, loader: ast.Call, size: int
) -> Iterator[Finding]:
    """The same under Lightning: its Trainer runs DDP over a LightningModule that
    builds BatchNorm, and sync_batchnorm=True is what converts it."""
    if not framework_processes(script):
        return
    norm = next(
        (line for cls in lightning_classes(script) if (line := batch_norm_in(script, [cls]))),
        None,
    )
    if norm is None:
        return
    for node, name in script.call_names:
        if name.split(".")[0] in LIGHTNING_PACKAGES and short(name) == "Trainer":
            yield script.finding(
                "batchnorm-not-synced",
                node,
                f"the Trainer runs a process per GPU over a LightningModule with plain BatchNorm "
                f"(line {norm}) trained on {size} sample{'s' if size != 1 else ''} per process "
                f"(the DataLoader on line {loader.lineno}): each GPU's BatchNorm normalises "
                "over those alone, so its statistics are noise and the model trains worse "
                "than one GPU with the same global batch; pass sync_batchnorm=True",
            )
            return


def may_sync_batchnorm(script: Script) -> bool:
    """SyncBatchNorm appears anywhere, even behind a flag (`sync_batchnorm=args.sync_bn`):
    the author chose. Lightning's `sync_batchnorm=False` says the opposite."""
    if SYNC_STRINGS & script.string_constants:
        return True
    return any(
        (isinstance(node, ast.Name) and node.id in SYNC_NAMES)
        or (isinstance(node, ast.Attribute) and node.attr in SYNC_NAMES)
        or (
            isinstance(node, ast.keyword)
            and node.arg in SYNC_NAMES
            and not (isinstance(node.value, ast.Constant) and node.value.value is False)
        )
        for node in script.nodes
    )


def small_training_loaders(script: Script) -> list[tuple[ast.Call, int, int | None]]:
    """Training DataLoaders (drawing through a sampler or shuffling, not assigned
    to a val / test name) whose batch size resolves to at most SMALL_PER_GPU_BATCH:
    (the loader, that size, and the global batch when the size is a global batch
    divided over the processes, `max(1, args.batch_size // world)`: at most half
    of it, as a DDP run has two processes or more)."""
    evaluation = {
        id(node.value)
        for node in script.of_type(ast.Assign)
        if any(EVALUATION_LOADER.search(full_text(t)) for t in node.targets)
    }
    found = []
    for node, name in script.call_names:
        if short(name) != "DataLoader" or id(node) in evaluation or not shuffles(node):
            continue
        given = keyword(node, "batch_size") or (node.args[1] if len(node.args) > 1 else None)
        size = resolved_int(script, given)
        shared = global_batch_divided(script, given)
        if shared is not None:
            size = shared // 2
        if size is not None and 0 < size <= SMALL_PER_GPU_BATCH:
            found.append((node, size, shared))
    return found


WORLD_SIZE = re.compile(r"world|nprocs|n_?gpus|num_gpus|replicas|num_processes", re.IGNORECASE)


def global_batch_divided(script: Script, given: ast.expr | None) -> int | None:
    """The global batch a per-process batch size divides by the number of processes
    (`args.batch_size // world`, `max(1, bs // dist.get_world_size())`, `int(bs /
    world)`), through a name assigned it once; None for anything else."""
    if isinstance(given, ast.Name):
        values = script.assigned_values.get(given.id, [])
        given = values[0] if len(values) == 1 else None
    while isinstance(given, ast.Call) and short(script.name_of(given.func)) in ("max", "int"):
        # max(1, x // world): the 1 is a floor, the share is the other argument
        divided = [a for a in given.args if not isinstance(a, ast.Constant)]
        given = divided[0] if len(divided) == 1 else None
    if not (isinstance(given, ast.BinOp) and isinstance(given.op, ast.FloorDiv | ast.Div)):
        return None
    if not WORLD_SIZE.search(source_text(given.right)):
        return None
    return resolved_int(script, given.left)


def shuffles(loader: ast.Call) -> bool:
    """A sampler (DistributedSampler, in a DDP script) or shuffle=True: a training
    loader; a fixed-order one of one sample is for scoring (Fisher, saliency)."""
    shuffle = keyword(loader, "shuffle")
    given_true = isinstance(shuffle, ast.Constant) and shuffle.value is True
    return keyword(loader, "sampler") is not None or given_true


def broadcasts_buffers(ddp: ast.Call) -> bool:
    """DDP left at broadcast_buffers=True: not given, or given True (`**options` may set it)."""
    value = keyword(ddp, "broadcast_buffers")
    if value is not None:
        return isinstance(value, ast.Constant) and value.value is True
    return not any(given.arg is None for given in ddp.keywords)


def wrapper_names(script: Script, ddp: ast.Call) -> set[str]:
    """The names the DDP call is assigned to (`disc = DDP(...)`, `self.model = DDP(...)`):
    calls of the module it wraps, by its own name, go around DDP and sync nothing."""
    return {
        source_text(target)
        for node in script.of_type(ast.Assign)
        if node.value is ddp
        for target in node.targets
    }


def batch_norm_built(script: Script, ddp: ast.Call, names: set[str]) -> int | None:
    """The line of a BatchNorm the wrapped model builds: in the expressions that
    make it, through the file's classes and functions they call, transitively."""
    values: list[ast.AST] = [ddp.args[0]] if ddp.args else []
    values += [v for name in names for v in values_where(script, ddp, name)]
    return batch_norm_in(script, values)


def values_where(script: Script, node: ast.AST, name: str) -> list[ast.expr]:
    """What the plain `name` is assigned in the function that holds `node` or at module
    level (another function's `net` is its own); the file's assignments of it where
    those have none (a parameter, a field set elsewhere)."""
    local = assignments_seen_from(script, node).get(name, [])
    return local or script.assigned_values.get(name, [])


def batch_norm_in(script: Script, values: list[ast.AST]) -> int | None:
    """The line of a BatchNorm built in `values`, or in the file's classes and
    functions they call, transitively."""
    values = list(values)
    builders = {
        node.name: node
        for node in script.tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef)
    }
    seen: set[str] = set()
    while values:
        value = values.pop()
        for node in walk(value):
            if not isinstance(node, ast.Call):
                continue
            name = script.name_of(node.func) or source_text(node.func)
            norm = norm_given(node)
            if norm is not None:  # `norm_layer=FrozenBatchNorm2d` replaces the model's own
                if BATCH_NORM_SETTING.search(norm) and not UNMOVING_NORM.search(norm):
                    return node.lineno
                continue
            if BATCH_NORM.match(short(name)) or torchvision_bn_model(name):
                return node.lineno
            if smp_bn_model(name, node):
                return node.lineno
            if picks_a_torchvision_bn_model(script, node):
                return node.lineno
            called = node.func.id if isinstance(node.func, ast.Name) else None
            if called in builders and called not in seen and len(seen) < MAX_BUILDERS:
                seen.add(called)
                values.append(builders[called])
    return None


def norm_given(call: ast.Call) -> str | None:
    """The text of the norm a call is told to build (`norm_layer=...`, `norm_cfg=...`)."""
    return next((full_text(k.value) for k in call.keywords if k.arg in NORM_KEYWORDS), None)


# segmentation_models_pytorch's architectures whose decoder (or ASPP / PSP block) is
# built of BatchNorm whatever the encoder (FPN's decoder uses GroupNorm: left out).
SMP_BN_MODELS = frozenset(
    {"Unet", "UnetPlusPlus", "Linknet", "MAnet", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "PAN"}
)


def smp_bn_model(name: str, call: ast.Call) -> bool:
    """`smp.Unet("resnet34", ...)`, unless told `decoder_use_batchnorm=False` (or
    `psp_use_batchnorm=False`)."""
    owner, _, model = name.rpartition(".")
    if not owner.startswith("segmentation_models_pytorch") or model not in SMP_BN_MODELS:
        return False
    return not any(
        k.arg
        and k.arg.endswith("use_batchnorm")
        and isinstance(k.value, ast.Constant)
        and k.value.value is False
        for k in call.keywords
    )


def torchvision_bn_model(name: str) -> bool:
    owner, _, function = name.rpartition(".")
    return owner.startswith("torchvision.models") and bool(TORCHVISION_BN_MODELS.match(function))


# Any torchvision model name (classification, segmentation, detection builders).
TORCHVISION_MODEL_NAME = re.compile(
    r"^(resnet|resnext|wide_resnet|densenet|mobilenet|efficientnet|regnet|vgg|inception|"
    r"googlenet|shufflenet|mnasnet|deeplabv3|fcn_|lraspp|alexnet|squeezenet|vit_|swin_|"
    r"convnext|maxvit)\w*$"
)


def picks_a_torchvision_bn_model(script: Script, call: ast.Call) -> bool:
    """`getattr(torchvision.models, arch)(...)` (or `models.__dict__[arch](...)`, `get_model(
    arch)`): a model picked by name. BatchNorm when every torchvision model name the
    file writes (its `--arch` default and choices) is one built with BatchNorm."""
    func = call.func
    picked = (
        isinstance(func, ast.Call)
        and script.name_of(func.func) == "getattr"
        and len(func.args) >= 2
        and script.name_of(func.args[0]) == "torchvision.models"
    )
    picked = picked or (
        isinstance(func, ast.Subscript)
        and script.name_of(func.value).startswith("torchvision.models")
    )
    picked = picked or script.name_of(func) == "torchvision.models.get_model"
    if not picked:
        return False
    named = [text for text in script.string_constants if TORCHVISION_MODEL_NAME.match(text)]
    return bool(named) and all(TORCHVISION_BN_MODELS.match(text) for text in named)


def second_calls_before_backward(
    script: Script, scope: ast.AST, names: set[str]
) -> Iterator[tuple[ast.Call, ast.Call]]:
    """Pairs of consecutive wrapper calls in `scope`, the first kept for
    backward, with no backward between them and one after the second, on
    the same path (not the two arms of one `if`)."""
    nodes = script.scope_nodes(scope)
    no_grad = inside_no_grad(nodes)
    detached = {
        id(node.value)
        for node in nodes
        if isinstance(node, ast.Attribute) and node.attr in ("detach", "item")
    }
    calls = [
        node for node in nodes if isinstance(node, ast.Call) and source_text(node.func) in names
    ]
    # where each backward ends: `loss_of(model(x)).backward()` runs after the call inside it
    backwards = [
        (node.end_lineno or node.lineno, node.end_col_offset or 0)
        for node in nodes
        if is_backward(node)
    ]
    if len(calls) < 2 or not backwards:
        return
    arms = branch_arms(scope)
    calls.sort(key=position)
    for first, second in itertools.pairwise(calls):
        if id(first) in no_grad or id(first) in detached:
            continue
        if any(position(first) < b < position(second) for b in backwards):
            continue
        if not any(b > position(second) for b in backwards):
            continue
        if exclusive(arms.get(id(first), ()), arms.get(id(second), ())):
            continue
        yield first, second


def branch_arms(scope: ast.AST) -> dict[int, tuple[tuple[int, str], ...]]:
    """For each node of the scope, the `if` arms it sits in: (id of the If, "body" or "orelse")."""
    arms: dict[int, tuple[tuple[int, str], ...]] = {}
    stack: list[tuple[ast.AST, tuple[tuple[int, str], ...]]] = [(scope, ())]
    while stack:
        node, path = stack.pop()
        arms[id(node)] = path
        if isinstance(node, ast.If | ast.IfExp):
            stack.append((node.test, path))
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            stack += [(child, (*path, (id(node), "body"))) for child in body]
            stack += [(child, (*path, (id(node), "orelse"))) for child in orelse]
            continue
        stack += [(child, path) for child in children(node)]
    return arms


def exclusive(first: tuple[tuple[int, str], ...], second: tuple[tuple[int, str], ...]) -> bool:
    """The two nodes sit in different arms of the same `if`: one runs, not both."""
    taken = dict(first)
    return any(branch in taken and taken[branch] != arm for branch, arm in second)


@check("syncbn-without-process-group")
def check_sync_batchnorm_on_the_cpu(script: Script) -> Iterator[Finding]:
    """SyncBatchNorm in a file that trains on the CPU: every process group it starts is
    gloo, and nothing in it names CUDA (no `.cuda()`, no "cuda" device, no
    torch.cuda call). SyncBatchNorm works on GPU modules only: DDP refuses the model
    ("SyncBatchNorm layers only work with GPU modules"), and without DDP its forward
    fails ("SyncBatchNorm expected input tensor to be on GPU"): keep plain BatchNorm
    on the CPU (or GroupNorm)."""
    backends = [backend_of(call) for call in init_calls(script)]
    if not backends or any(backend != "gloo" for backend in backends) or names_cuda(script):
        return
    for node, name in script.call_names:
        if short(name) in ("SyncBatchNorm", SYNC_CONVERSION):
            yield script.finding(
                "syncbn-without-process-group",
                node,
                "SyncBatchNorm in a run on the CPU (a gloo process group, nothing on a GPU): "
                'it works on GPU modules only, so DDP refuses the model ("SyncBatchNorm '
                'layers only work with GPU modules") or its forward fails ("SyncBatchNorm '
                'expected input tensor to be on GPU"); keep plain BatchNorm (or GroupNorm) '
                "on the CPU",
            )


def names_cuda(script: Script) -> bool:
    """The file puts something on a GPU, or may: `.cuda()`, torch.cuda, a "cuda" device,
    device_ids, or another accelerator's device string."""
    return any(
        (isinstance(node, ast.Attribute) and node.attr in ("cuda", "device_ids"))
        or (isinstance(node, ast.Name) and node.id == "cuda")
        or (isinstance(node, ast.keyword) and node.arg == "device_ids")
        or (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.search(r"\b(cuda|xpu|npu|mps|hpu)\b", node.value)
        )
        for node in script.nodes
    )

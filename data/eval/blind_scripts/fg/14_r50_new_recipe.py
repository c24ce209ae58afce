"""ResNet-50 "new recipe" training with cached ImageFolder indexes, EMA and --test-only.

Self-contained variant of torchvision/references/classification/train.py for the shared
cluster (ImageFolder indexing of the NFS copy takes ~10 min, so we cache it).

    torchrun --nproc_per_node=8 train_r50.py --data-path /nfs/imagenet --cache-dataset \
        --batch-size 128 --lr 0.5 --epochs 600 --model-ema --sync-bn --amp --output-dir /nfs/runs/r50_v2
"""
import argparse
import datetime
import hashlib
import os
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.optim.swa_utils import AveragedModel

import presets

# ---- helpers from references/classification/utils.py ----
def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def setup_for_distributed(is_master):
    import builtins as __builtin__

    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop("force", False)
        if is_master or force:
            builtin_print(*args, **kwargs)

    __builtin__.print = print


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    else:
        print("Not using distributed mode")
        args.distributed = False
        args.rank, args.world_size, args.gpu = 0, 1, 0
        return

    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()
    setup_for_distributed(args.rank == 0)


class SmoothedValue:
    def __init__(self, window_size=20, fmt=None):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt or "{median:.4f} ({global_avg:.4f})"

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    def synchronize_between_processes(self):
        if not is_dist_avail_and_initialized():
            return
        t = torch.tensor([self.count, self.total], dtype=torch.float64, device="cuda")
        dist.barrier()
        dist.all_reduce(t)
        t = t.tolist()
        self.count = int(t[0])
        self.total = t[1]

    @property
    def median(self):
        return torch.tensor(list(self.deque)).median().item()

    @property
    def avg(self):
        return torch.tensor(list(self.deque), dtype=torch.float32).mean().item()

    @property
    def global_avg(self):
        return self.total / max(self.count, 1)

    @property
    def value(self):
        return self.deque[-1]

    def __str__(self):
        return self.fmt.format(median=self.median, avg=self.avg, global_avg=self.global_avg, value=self.value)


class MetricLogger:
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            self.meters[k].update(v)

    def __getattr__(self, attr):
        if attr in self.meters:
            return self.meters[attr]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")

    def __str__(self):
        return self.delimiter.join(f"{name}: {meter}" for name, meter in self.meters.items())

    def synchronize_between_processes(self):
        for meter in self.meters.values():
            meter.synchronize_between_processes()

    def add_meter(self, name, meter):
        self.meters[name] = meter

    def log_every(self, iterable, print_freq, header=""):
        start_time = time.time()
        end = time.time()
        iter_time = SmoothedValue(fmt="{avg:.4f}")
        data_time = SmoothedValue(fmt="{avg:.4f}")
        n = len(iterable)
        for i, obj in enumerate(iterable):
            data_time.update(time.time() - end)
            yield obj
            iter_time.update(time.time() - end)
            if i % print_freq == 0 or i == n - 1:
                eta = datetime.timedelta(seconds=int(iter_time.global_avg * (n - i)))
                mem = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0
                print(f"{header} [{i}/{n}] eta: {eta} {self} time: {iter_time} data: {data_time} mem: {mem:.0f}MB")
            end = time.time()
        total_time = time.time() - start_time
        print(f"{header} Total time: {datetime.timedelta(seconds=int(total_time))} ({total_time / max(n, 1):.4f} s / it)")


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])
        res = []
        for k in topk:
            correct_k = correct[:k].flatten().sum(dtype=torch.float32)
            res.append(correct_k * (100.0 / batch_size))
        return res


class ExponentialMovingAverage(AveragedModel):
    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def _get_cache_path(filepath):
    h = hashlib.sha1(filepath.encode()).hexdigest()
    cache_path = os.path.join("~", ".torch", "vision", "datasets", "imagefolder", h[:10] + ".pt")
    return os.path.expanduser(cache_path)


def load_split(directory, transform, args):
    cache_path = _get_cache_path(directory)
    if args.cache_dataset and os.path.exists(cache_path):
        print(f"Loading dataset index from {cache_path}")
        dataset, _ = torch.load(cache_path, weights_only=False)
        dataset.transform = transform
        return dataset
    dataset = torchvision.datasets.ImageFolder(directory, transform)
    if args.cache_dataset and is_main_process():
        print(f"Saving dataset index to {cache_path}")
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        tmp_path = f"{cache_path}.tmp{os.getpid()}"
        torch.save((dataset, directory), tmp_path)
        os.replace(tmp_path, cache_path)  # readers only ever see a complete file
    return dataset


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value}"))
    header = f"Epoch: [{epoch}]"
    for i, (image, target) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

        if model_ema is not None and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)

        acc1, = accuracy(output, target, topk=(1,))
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=image.shape[0])


@torch.inference_mode()
def evaluate(model, data_loader, device, log_suffix=""):
    model.eval()
    # [correct@1, correct@5, seen]; counted on the GPU so the all_reduce can use NCCL
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for image, target in data_loader:
        image = image.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(image)
        top5 = output.topk(5, dim=1).indices
        hit = top5.eq(target[:, None])
        stats[0] += hit[:, 0].sum()
        stats[1] += hit.any(dim=1).sum()
        stats[2] += target.numel()
    if is_dist_avail_and_initialized():
        dist.all_reduce(stats)
    acc1 = (stats[0] / stats[2]).item() * 100
    acc5 = (stats[1] / stats[2]).item() * 100
    print(f"Test {log_suffix}: {int(stats[2].item())} images  Acc@1 {acc1:.3f}  Acc@5 {acc5:.3f}")
    return acc1


def main(args):
    init_distributed_mode(args)
    if args.output_dir and is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
    print(args)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    dataset = load_split(
        os.path.join(args.data_path, "train"),
        presets.ClassificationPresetTrain(crop_size=176, auto_augment_policy="ta_wide", random_erase_prob=0.1),
        args,
    )
    dataset_test = load_split(
        os.path.join(args.data_path, "val"), presets.ClassificationPresetEval(crop_size=224, resize_size=232), args
    )

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        # every val image exactly once over all ranks (DistributedSampler would pad with repeats)
        dataset_test = torch.utils.data.Subset(dataset_test, range(args.rank, len(dataset_test), args.world_size))
    else:
        train_sampler = torch.utils.data.RandomSampler(dataset)

    data_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
        pin_memory=True, drop_last=True,
    )
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=args.batch_size, shuffle=False, num_workers=args.workers, pin_memory=True
    )

    model = torchvision.models.resnet50(num_classes=len(dataset.classes), zero_init_residual=True)
    if args.distributed and args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)

    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    norm_params = [p for n, p in model.named_parameters() if p.ndim <= 1]
    other_params = [p for n, p in model.named_parameters() if p.ndim > 1]
    lr = args.lr * args.batch_size * args.world_size / 1024
    optimizer = torch.optim.SGD(
        [{"params": other_params, "weight_decay": args.weight_decay}, {"params": norm_params, "weight_decay": 0.0}],
        lr=lr, momentum=0.9,
    )
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.lr_warmup_epochs)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.lr_warmup_epochs])

    model_without_ddp = model
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    model_ema = None
    if args.model_ema:
        adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
        alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
        model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(checkpoint["model"])
        if not args.test_only:
            optimizer.load_state_dict(checkpoint["optimizer"])
            lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
            if scaler is not None:
                scaler.load_state_dict(checkpoint["scaler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema is not None:
            model_ema.load_state_dict(checkpoint["model_ema"])

    if args.test_only:
        evaluate(model_without_ddp, data_loader_test, device)
        if model_ema is not None:
            evaluate(model_ema, data_loader_test, device, log_suffix="EMA")
        return

    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler)
        lr_scheduler.step()
        evaluate(model_without_ddp, data_loader_test, device)
        if model_ema is not None:
            evaluate(model_ema, data_loader_test, device, log_suffix="EMA")
        if args.output_dir:
            checkpoint = {
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "args": args,
            }
            if model_ema is not None:
                checkpoint["model_ema"] = model_ema.state_dict()
            if scaler is not None:
                checkpoint["scaler"] = scaler.state_dict()
            save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))

    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")


def get_args_parser():
    parser = argparse.ArgumentParser(description="ResNet-50 training")
    parser.add_argument("--data-path", default="/nfs/imagenet", type=str)
    parser.add_argument("--device", default="cuda", type=str)
    parser.add_argument("-b", "--batch-size", default=128, type=int, help="images per gpu")
    parser.add_argument("--epochs", default=600, type=int)
    parser.add_argument("-j", "--workers", default=12, type=int)
    parser.add_argument("--lr", default=0.5, type=float, help="lr for a global batch of 1024, scaled linearly")
    parser.add_argument("--lr-warmup-epochs", default=5, type=int)
    parser.add_argument("--wd", "--weight-decay", default=2e-5, type=float, dest="weight_decay")
    parser.add_argument("--cache-dataset", action="store_true")
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--model-ema-steps", default=32, type=int)
    parser.add_argument("--model-ema-decay", default=0.99998, type=float)
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--print-freq", default=100, type=int)
    parser.add_argument("--output-dir", default="/nfs/runs/r50_v2", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--test-only", action="store_true")
    parser.add_argument("--dist-url", default="env://", type=str)
    return parser


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
    if args.distributed:
        dist.destroy_process_group()

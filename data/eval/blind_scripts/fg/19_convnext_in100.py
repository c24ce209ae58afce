"""ConvNeXt-T on ImageNet-100 with MixUp/CutMix and EMA, logging to Weights & Biases.

Single-file version of torchvision's classification reference that we launch with

    torchrun --standalone --nproc_per_node=8 train_convnext_wandb.py \
        --data-path /data/imagenet100 --batch-size 128 --epochs 300 --amp --model-ema \
        --wandb-project in100-convnext --run-name cnxt_t_bs1024
"""
import argparse
import datetime
import os
import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist
import torchvision
import wandb
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data.dataloader import default_collate
from torchvision.transforms import v2

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


def build_data(args):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    to_tensor = [v2.PILToTensor(), v2.ToDtype(torch.float, scale=True), v2.Normalize(mean, std)]
    train_tf = v2.Compose(
        [v2.RandomResizedCrop(args.train_crop_size, antialias=True), v2.RandomHorizontalFlip(),
         v2.RandAugment(num_ops=2, magnitude=9)] + to_tensor + [v2.RandomErasing(p=0.25)]
    )
    val_tf = v2.Compose([v2.Resize(236, antialias=True), v2.CenterCrop(224)] + to_tensor)
    dataset = torchvision.datasets.ImageFolder(os.path.join(args.data_path, "train"), train_tf)
    dataset_test = torchvision.datasets.ImageFolder(os.path.join(args.data_path, "val"), val_tf)
    return dataset, dataset_test


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):
    model.train()
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.6f}"))
    header = f"Epoch: [{epoch}]"
    for i, (image, target) in enumerate(metric_logger.log_every(data_loader, args.print_freq, header)):
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        if model_ema is not None and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)

        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = image.shape[0]
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)

        if i % args.print_freq == 0:
            step = epoch * len(data_loader) + i
            wandb.log({"train/loss": loss.item(), "train/lr": optimizer.param_groups[0]["lr"]}, step=step)

    metric_logger.synchronize_between_processes()
    return metric_logger.loss.global_avg


def evaluate(model, criterion, data_loader, device, log_suffix=""):
    model.eval()
    metric_logger = MetricLogger(delimiter="  ")
    header = f"Test: {log_suffix}"
    with torch.inference_mode():
        for image, target in metric_logger.log_every(data_loader, 100, header):
            image = image.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(image)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            batch_size = image.shape[0]
            metric_logger.update(loss=loss.item())
            metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
            metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)

    metric_logger.synchronize_between_processes()
    print(f"{header} Acc@1 {metric_logger.acc1.global_avg:.3f} Acc@5 {metric_logger.acc5.global_avg:.3f}")
    return metric_logger.acc1.global_avg, metric_logger.acc5.global_avg


def main(args):
    init_distributed_mode(args)
    if args.output_dir and is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
    print(args)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), dir=args.output_dir)

    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    dataset, dataset_test = build_data(args)
    num_classes = len(dataset.classes)
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)
    else:
        train_sampler = torch.utils.data.RandomSampler(dataset)
        test_sampler = torch.utils.data.SequentialSampler(dataset_test)

    cutmix_or_mixup = v2.RandomChoice([
        v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes),
        v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes),
    ])

    def collate_fn(batch):
        return cutmix_or_mixup(*default_collate(batch))

    data_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
        pin_memory=True, collate_fn=collate_fn, drop_last=True,
    )
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=args.batch_size, sampler=test_sampler, num_workers=args.workers, pin_memory=True
    )

    model = torchvision.models.convnext_tiny(num_classes=num_classes, stochastic_depth_prob=0.1)
    model.to(device)

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.lr_warmup_epochs)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs, eta_min=1e-6)
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
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema is not None:
            model_ema.load_state_dict(checkpoint["model_ema"])

    if args.test_only:
        evaluate(model_ema if model_ema is not None else model, criterion, data_loader_test, device)
        return

    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema)
        lr_scheduler.step()
        acc1, acc5 = evaluate(model, criterion, data_loader_test, device)
        log = {"epoch": epoch, "train/epoch_loss": train_loss, "val/acc1": acc1, "val/acc5": acc5}
        if model_ema is not None:
            ema_acc1, _ = evaluate(model_ema, criterion, data_loader_test, device, log_suffix="EMA")
            log["val/ema_acc1"] = ema_acc1
        wandb.log(log, step=(epoch + 1) * len(data_loader))

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
            save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            save_on_master(checkpoint, os.path.join(args.output_dir, "checkpoint.pth"))

    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")
    wandb.finish()


def get_args_parser():
    parser = argparse.ArgumentParser(description="ConvNeXt training")
    parser.add_argument("--data-path", default="/data/imagenet100", type=str)
    parser.add_argument("--device", default="cuda", type=str)
    parser.add_argument("-b", "--batch-size", default=128, type=int, help="images per gpu")
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("-j", "--workers", default=10, type=int)
    parser.add_argument("--lr", default=4e-3, type=float, help="for a total batch of 1024 (8 x 128)")
    parser.add_argument("--wd", "--weight-decay", default=0.05, type=float, dest="weight_decay")
    parser.add_argument("--lr-warmup-epochs", default=20, type=int)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--mixup-alpha", default=0.8, type=float)
    parser.add_argument("--cutmix-alpha", default=1.0, type=float)
    parser.add_argument("--train-crop-size", default=176, type=int)
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--model-ema-steps", default=32, type=int)
    parser.add_argument("--model-ema-decay", default=0.99998, type=float)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--print-freq", default=50, type=int)
    parser.add_argument("--output-dir", default="./runs/convnext_t", type=str)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--test-only", action="store_true")
    parser.add_argument("--wandb-project", default="in100-convnext", type=str)
    parser.add_argument("--run-name", default=None, type=str)
    parser.add_argument("--dist-url", default="env://", type=str)
    return parser


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
    if args.distributed:
        dist.destroy_process_group()

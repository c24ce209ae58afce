# ResNet-50 ImageNet training, torchvision-reference recipe (cosine + warmup, label smoothing, EMA, AutoAugment).
# Submitted with sbatch; srun starts one task per GPU:
#   srun --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=10 python 16_resnet_slurm.py --output-dir $CKPT
import argparse
import datetime
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import Sampler
from torchvision.transforms import autoaugment, transforms


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    elif "SLURM_PROCID" in os.environ:
        args.rank = int(os.environ["SLURM_PROCID"])
        args.world_size = int(os.environ["SLURM_NTASKS"])
        args.gpu = args.rank
        node_list = os.environ["SLURM_NODELIST"]
        addr = subprocess.getoutput(f"scontrol show hostname {node_list} | head -n1")
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", "29500")
    else:
        print("Not using distributed mode")
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print(f"| distributed init (rank {args.rank}): {args.dist_url}", flush=True)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


class ExponentialMovingAverage(AveragedModel):
    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param
        super().__init__(model, device, ema_avg, use_buffers=True)


class ShardSampler(Sampler):
    def __init__(self, dataset):
        self.indices = list(range(len(dataset)))[get_rank()::get_world_size()]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema=None, scaler=None):
    model.train()
    t0 = time.time()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)
        if i % args.print_freq == 0 and is_main_process():
            acc1 = (output.argmax(1) == target).float().mean().item() * 100
            print(f"Epoch: [{epoch}] [{i}/{len(data_loader)}] loss {loss.item():.4f} acc1 {acc1:.2f} "
                  f"lr {optimizer.param_groups[0]['lr']:.4f} img/s {(i + 1) * image.size(0) / (time.time() - t0):.0f}")


@torch.no_grad()
def evaluate(model, data_loader, device, num_samples, log_suffix=""):
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for image, target in data_loader:
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(image)
        top5 = output.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == target).sum()
        stats[1] += (top5 == target[:, None]).any(dim=1).sum()
        stats[2] += image.size(0)
    if get_world_size() > 1:
        dist.all_reduce(stats)
    assert int(stats[2].item()) == num_samples
    acc1, acc5 = (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()
    print(f"{log_suffix} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}")
    return acc1


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    args.lr = args.lr * args.batch_size * get_world_size() / 1024

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    dataset = torchvision.datasets.ImageFolder(os.path.join(args.data_path, "train"), transforms.Compose([
        transforms.RandomResizedCrop(176), transforms.RandomHorizontalFlip(),
        autoaugment.TrivialAugmentWide(), transforms.PILToTensor(), transforms.ConvertImageDtype(torch.float),
        normalize, transforms.RandomErasing(p=0.1)]))
    dataset_test = torchvision.datasets.ImageFolder(os.path.join(args.data_path, "val"), transforms.Compose([
        transforms.Resize(232), transforms.CenterCrop(224), transforms.PILToTensor(),
        transforms.ConvertImageDtype(torch.float), normalize]))
    train_sampler = torch.utils.data.distributed.DistributedSampler(dataset) if args.distributed else \
        torch.utils.data.RandomSampler(dataset)
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler,
                                              num_workers=args.workers, pin_memory=True, drop_last=True)
    data_loader_test = torch.utils.data.DataLoader(dataset_test, batch_size=args.batch_size, sampler=ShardSampler(dataset_test),
                                                   num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnet50(weights=None, num_classes=1000)
    if args.distributed and args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    norm_params = [p for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()]
    norm_ids = {id(p) for p in norm_params}
    other_params = [p for p in model.parameters() if id(p) not in norm_ids]
    optimizer = torch.optim.SGD([{"params": other_params}, {"params": norm_params, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None
    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.lr_warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup_lr_scheduler, main_lr_scheduler],
                                                         milestones=[args.lr_warmup_epochs])

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    model_ema = None
    if args.model_ema:
        # decay adjusted to the number of images seen between EMA updates
        adjust = get_world_size() * args.batch_size * args.model_ema_steps / args.epochs
        alpha = 1.0 - min(1.0, (1.0 - args.model_ema_decay) * adjust)
        model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pth")
    if os.path.exists(checkpoint_path):
        checkpoint = torch.load(checkpoint_path, map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema:
            model_ema.load_state_dict(checkpoint["model_ema"])
        if scaler:
            scaler.load_state_dict(checkpoint["scaler"])

    print("Start training")
    start_time = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, args, model_ema, scaler)
        lr_scheduler.step()
        evaluate(model_without_ddp, data_loader_test, device, len(dataset_test))
        if model_ema:
            evaluate(model_ema.module, data_loader_test, device, len(dataset_test), log_suffix="EMA")
        checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                      "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args}
        if model_ema:
            checkpoint["model_ema"] = model_ema.state_dict()
        if scaler:
            checkpoint["scaler"] = scaler.state_dict()
        save_on_master(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))
        save_on_master(checkpoint, checkpoint_path)

    print(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")
    if args.distributed:
        dist.destroy_process_group()


def get_args_parser():
    parser = argparse.ArgumentParser(description="PyTorch Classification Training")
    parser.add_argument("--data-path", default="/datasets01/imagenet_full_size/061417/", type=str)
    parser.add_argument("-b", "--batch-size", default=128, type=int, help="images per gpu")
    parser.add_argument("--epochs", default=600, type=int)
    parser.add_argument("-j", "--workers", default=10, type=int)
    parser.add_argument("--lr", default=0.5, type=float, help="for 1024 images (8 GPUs x 128)")
    parser.add_argument("--weight-decay", default=2e-5, type=float)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--lr-warmup-epochs", default=5, type=int)
    parser.add_argument("--print-freq", default=100, type=int)
    parser.add_argument("--output-dir", default=".", type=str)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--model-ema", action="store_true")
    parser.add_argument("--model-ema-steps", type=int, default=32)
    parser.add_argument("--model-ema-decay", type=float, default=0.99998)
    parser.add_argument("--dist-url", default="env://", type=str)
    return parser


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)

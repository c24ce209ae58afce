"""RegNetY-16GF on iNaturalist-2021 over 4 nodes with 25GbE between them, so gradients are
PowerSGD-compressed. A profiler trace is written by the first rank for a few steps of epoch 0.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        12_regnet_inat21.py --data /datasets/inat21 --out /shared/inat/regnety16
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powerSGD
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


class DevicePrefetcher:
    def __init__(self, loader, device):
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device)
        self.mean, self.std = MEAN.to(device), STD.to(device)

    def __len__(self):
        return len(self.loader)

    def _copy(self, batch):
        x, y = batch
        with torch.cuda.stream(self.stream):
            x = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
            x = x.contiguous(memory_format=torch.channels_last)
            y = y.to(self.device, non_blocking=True)
        return x, y

    def __iter__(self):
        cur = torch.cuda.current_stream(self.device)
        it = iter(self.loader)
        try:
            nxt = self._copy(next(it))
        except StopIteration:
            return
        for batch in it:
            cur.wait_stream(self.stream)
            x, y = nxt
            x.record_stream(cur)
            y.record_stream(cur)
            nxt = self._copy(batch)
            yield x, y
        cur.wait_stream(self.stream)
        x, y = nxt
        x.record_stream(cur)
        y.record_stream(cur)
        yield x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.2, help="for global batch 512")
    ap.add_argument("--wd", type=float, default=5e-5)
    ap.add_argument("--psgd-rank", type=int, default=2)
    ap.add_argument("--psgd-start", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    to_u8 = T.PILToTensor()
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"),
                                                T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), to_u8]))
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"),
                                              T.Compose([T.Resize(256), T.CenterCrop(224), to_u8]))
    n_classes = len(train_ds.classes)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                        num_workers=args.workers, pin_memory=True)

    model = torchvision.models.regnet_y_16gf(num_classes=n_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev, memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[local_rank], static_graph=True, gradient_as_bucket_view=True,
              bucket_cap_mb=25)
    psgd_state = powerSGD.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.psgd_rank,
        start_powerSGD_iter=args.psgd_start,
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    ddp.register_comm_hook(psgd_state, powerSGD.powerSGD_hook)

    lr = args.lr * args.bs * world / 512
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True,
                          foreach=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05, anneal_strategy="cos")
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    start_epoch = 0
    ck_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    prof_ctx = contextlib.nullcontext()
    if args.profile and rank == 0:
        prof_ctx = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=50, warmup=5, active=5, repeat=1),
            on_trace_ready=tensorboard_trace_handler(os.path.join(args.out, "trace")),
            record_shapes=True, with_stack=False,
        )

    with prof_ctx as prof:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            ddp.train()
            t0 = time.perf_counter()
            run_loss = torch.zeros((), device=dev)
            for i, (x, y) in enumerate(DevicePrefetcher(train_dl, dev)):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(ddp(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                run_loss += loss.detach()
                if prof is not None:
                    prof.step()
                if (i + 1) % 100 == 0:
                    dist.all_reduce(run_loss, op=dist.ReduceOp.AVG)
                    torch.cuda.synchronize()
                    dt = (time.perf_counter() - t0) / 100
                    if rank == 0:
                        print(f"ep {epoch} {i + 1}/{len(train_dl)} loss {run_loss.item() / 100:.3f} "
                              f"{args.bs * world / dt:.0f} img/s", flush=True)
                    run_loss.zero_()
                    t0 = time.perf_counter()

            # eval on the unwrapped module: the val shards differ by one image between ranks
            model.eval()
            hit = torch.zeros(2, device=dev, dtype=torch.float64)
            with torch.no_grad():
                for x, y in DevicePrefetcher(val_dl, dev):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        pred = model(x).argmax(1)
                    hit[0] += (pred == y).sum()
                    hit[1] += y.numel()
            dist.all_reduce(hit)
            if rank == 0:
                print(f"epoch {epoch}: top1 {100 * hit[0].item() / hit[1].item():.2f}", flush=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "epoch": epoch}, ck_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Keyword spotting on Speech Commands v2 (35 words), multi-GPU via mp.spawn.

    python 11_spawn_keyword_spotting.py --root /data/speech_commands --out /shared/kws/res15 --accum 2

Log-mel features are computed once and cached under <root>/cache/.
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


LABELS = sorted("""backward bed bird cat dog down eight five follow forward four go happy house learn left
marvin nine no off on one right seven sheila six stop three tree two up visual wow yes zero""".split())


def build_cache(root, split, cache_file):
    ds = torchaudio.datasets.SPEECHCOMMANDS(root, download=True, subset=split)
    lut = {w: i for i, w in enumerate(LABELS)}
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=40)
    feats, ys = [], []
    for wav, sr, word, *_ in ds:
        wav = F.pad(wav, (0, 16000 - wav.size(1)))[:, :16000]
        feats.append((mel(wav) + 1e-6).log())
        ys.append(lut[word])
    torch.save({"x": torch.stack(feats), "y": torch.tensor(ys)}, cache_file + ".tmp")
    os.replace(cache_file + ".tmp", cache_file)


def load_split(root, split, rank):
    cache_dir = os.path.join(root, "cache")
    cache_file = os.path.join(cache_dir, f"{split}_logmel40.pt")
    if rank == 0 and not os.path.exists(cache_file):
        os.makedirs(cache_dir, exist_ok=True)
        build_cache(root, split, cache_file)
    dist.barrier()
    blob = torch.load(cache_file)
    return TensorDataset(blob["x"], blob["y"])


class Res15(nn.Module):
    def __init__(self, n_cls, ch=45, layers=13):
        super().__init__()
        self.conv0 = nn.Conv2d(1, ch, 3, padding=1, bias=False)
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        for i in range(layers - 1):
            d = 2 ** (i // 3)
            self.convs.append(nn.Conv2d(ch, ch, 3, padding=d, dilation=d, bias=False))
            self.bns.append(nn.BatchNorm2d(ch, affine=False))
        self.fc = nn.Linear(ch, n_cls)

    def forward(self, x):
        x = F.relu(self.conv0(x))
        old = x
        for i, (c, b) in enumerate(zip(self.convs, self.bns)):
            x = b(F.relu(c(x)))
            if i % 2 == 1:
                x = x + old
                old = x
        return self.fc(x.mean((2, 3)))


def spec_augment(x, F_=7, T_=20):
    b, _, n_mel, n_t = x.shape
    f0 = torch.randint(0, n_mel - F_, (b,), device=x.device)
    t0 = torch.randint(0, n_t - T_, (b,), device=x.device)
    fm = (torch.arange(n_mel, device=x.device)[None] - f0[:, None]).clamp(min=0) < F_
    tm = (torch.arange(n_t, device=x.device)[None] - t0[:, None]).clamp(min=0) < T_
    fm &= torch.arange(n_mel, device=x.device)[None] >= f0[:, None]
    tm &= torch.arange(n_t, device=x.device)[None] >= t0[:, None]
    return x.masked_fill(fm[:, None, :, None] | tm[:, None, None, :], 0.0)


@torch.no_grad()
def evaluate(model, ds, gpu, rank, world):
    model.eval()
    dl = DataLoader(torch.utils.data.Subset(ds, range(rank, len(ds), world)), batch_size=512)
    c = torch.zeros(2, device=gpu)
    for x, y in dl:
        x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    # generous timeout: on a fresh root rank 0 downloads and featurises everything before the first barrier
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=gpu, world_size=ngpus,
                            timeout=datetime.timedelta(hours=2))
    rank = gpu

    train_ds = load_split(args.root, "training", rank)
    val_ds = load_split(args.root, "validation", rank)
    test_ds = load_split(args.root, "testing", rank)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                    pin_memory=True, drop_last=True)

    model = Res15(len(LABELS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    eff_batch = args.batch_size * ngpus * args.accum
    lr = args.lr * eff_batch / 64
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start, best = 0, 0.0
    ckpt = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location={"cuda:0": f"cuda:{gpu}"})
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start, best = st["epoch"] + 1, st["best"]

    run = None
    if rank == 0:
        run = wandb.init(project="kws", name=os.path.basename(args.out), config={**vars(args), "lr": lr,
                         "eff_batch": eff_batch}, resume="allow", id=os.path.basename(args.out))

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(dl):
            x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
            x = spec_augment(x)
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                loss = F.cross_entropy(model(x), y) / args.accum
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = F.cross_entropy(model(x), y) / args.accum
                    loss.backward()
        opt.zero_grad(set_to_none=True)
        sched.step()

        val_acc = evaluate(model, val_ds, gpu, rank, ngpus)
        if rank == 0:
            best = max(best, val_acc)
            run.log({"epoch": epoch, "val_acc": val_acc, "lr": sched.get_last_lr()[0],
                     "epoch_time": time.time() - t0})
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    test_acc = evaluate(model, test_ds, gpu, rank, ngpus)
    if rank == 0:
        run.summary["test_acc"] = test_acc
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1, help="for an effective batch of 64")
    ap.add_argument("--port", type=int, default=23456)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))

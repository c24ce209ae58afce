"""PANNs-style Cnn14 with decision-level attention (clip + frame outputs) on full AudioSet.

Iteration-based training with a class-balanced sampler, PANNs pairwise mixup and gradient accumulation.
Waveforms come from PANNs' packed HDF5 files (int16, 32 kHz).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        10_audioset_cnn14_att_sed.py --workspace /shared/panns_workspace
"""
import argparse
import contextlib
import logging
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats
from sklearn import metrics
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchaudio.transforms import AmplitudeToDB, FrequencyMasking, MelSpectrogram, TimeMasking

CLASSES_NUM = 527
SR = 32000


class PackedAudioSet(Dataset):
    """Indexes into the packed waveform HDF5; the file is opened lazily in each worker."""

    def __init__(self, hdf5_path):
        self.path = hdf5_path
        self.h5 = None
        with h5py.File(hdf5_path, "r") as f:
            self.targets = f["target"][:].astype(np.bool_)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        wav = self.h5["waveform"][i].astype(np.float32) / 32767.0
        return torch.from_numpy(wav), torch.from_numpy(self.targets[i].astype(np.float32))


class BalancedBatchSampler(Sampler):
    """Endless class-balanced batches (PANNs' BalancedTrainSampler), one random stream per rank."""

    def __init__(self, targets, batch_size, seed):
        self.batch_size = batch_size
        self.rs = np.random.RandomState(seed)
        self.idx_per_class = [np.where(targets[:, k])[0] for k in range(targets.shape[1])]
        self.queue, self.ptr = [], [0] * targets.shape[1]
        for ids in self.idx_per_class:
            self.rs.shuffle(ids)

    def __iter__(self):
        while True:
            batch = []
            while len(batch) < self.batch_size:
                if not self.queue:
                    self.queue = list(self.rs.permutation(CLASSES_NUM))
                k = self.queue.pop()
                ids = self.idx_per_class[k]
                if len(ids) == 0:
                    continue
                batch.append(int(ids[self.ptr[k]]))
                self.ptr[k] += 1
                if self.ptr[k] >= len(ids):
                    self.ptr[k] = 0
                    self.rs.shuffle(ids)
            yield batch


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x, pool):
        x = F.relu_(self.b2(self.c2(F.relu_(self.b1(self.c1(x))))))
        return F.avg_pool2d(x, pool) if pool != (1, 1) else x


class Cnn14AttSED(nn.Module):
    def __init__(self, classes_num=CLASSES_NUM):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(64)
        ch = [1, 64, 128, 256, 512, 1024, 2048]
        self.blocks = nn.ModuleList([ConvBlock(ch[i], ch[i + 1]) for i in range(6)])
        self.fc1 = nn.Linear(2048, 2048)
        self.att = nn.Conv1d(2048, classes_num, 1)
        self.cla = nn.Conv1d(2048, classes_num, 1)

    def forward(self, x):                            # x: (B, 1, T, 64)
        T = x.size(2)
        x = self.bn0(x.transpose(1, 3)).transpose(1, 3)
        for i, blk in enumerate(self.blocks):
            x = F.dropout(blk(x, (2, 2) if i < 5 else (1, 1)), 0.2, self.training)
        x = x.mean(3)                                # (B, C, T/32)
        x = F.max_pool1d(x, 3, 1, 1) + F.avg_pool1d(x, 3, 1, 1)
        x = F.dropout(x, 0.5, self.training)
        x = F.relu_(self.fc1(x.transpose(1, 2))).transpose(1, 2)
        x = F.dropout(x, 0.5, self.training)
        norm_att = torch.softmax(torch.tanh(self.att(x)), dim=-1)
        cla = torch.sigmoid(self.cla(x))
        clipwise = (norm_att * cla).sum(-1)
        framewise = F.interpolate(cla, size=T, mode="nearest").transpose(1, 2)   # (B, T, classes)
        return clipwise, framewise


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=1024, hop_length=320, n_mels=64, f_min=50, f_max=14000)
        self.db = AmplitudeToDB(top_db=None)
        self.specaug = nn.Sequential(TimeMasking(64), TimeMasking(64), FrequencyMasking(8), FrequencyMasking(8))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = self.db(self.mel(wav))
        if augment:
            x = self.specaug(x)
        return x.transpose(1, 2).unsqueeze(1)


def pairwise_mixup(x, y, rs, alpha=1.0):
    """PANNs mixup: batch of 2N -> N mixed examples (pairs 2i and 2i+1)."""
    lam = torch.as_tensor(rs.beta(alpha, alpha, size=x.size(0) // 2), dtype=x.dtype, device=x.device)
    xl = lam.view(-1, *[1] * (x.dim() - 1))
    yl = lam.view(-1, 1)
    return xl * x[0::2] + (1 - xl) * x[1::2], yl * y[0::2] + (1 - yl) * y[1::2]


@torch.no_grad()
def evaluate(model, frontend, loader, device):
    model.eval()
    out, tgt = [], []
    for wav, y in loader:
        clipwise, _ = model(frontend(wav.to(device), augment=False))
        out.append(clipwise.cpu().numpy())
        tgt.append(y.numpy())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (np.concatenate(out), np.concatenate(tgt)))
    p = np.concatenate([g[0] for g in gathered])
    t = np.concatenate([g[1] for g in gathered])
    ap = metrics.average_precision_score(t, p, average=None)
    auc = metrics.roc_auc_score(t, p, average=None)
    return float(np.nanmean(ap)), float(np.nanmean(auc)), float(stats.norm().ppf(np.nanmean(auc)) * math.sqrt(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU, before mixup halves it")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3, help="for 16 GPUs x 16 x 2 accumulation")
    ap.add_argument("--iterations", type=int, default=600_000)
    ap.add_argument("--eval-every", type=int, default=20_000)
    ap.add_argument("--resume-iteration", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("panns")
    torch.manual_seed(0)
    rs = np.random.RandomState(1000 + rank)

    ws = args.workspace
    train_set = PackedAudioSet(os.path.join(ws, "hdf5s/waveforms/full_train.h5"))
    eval_set = PackedAudioSet(os.path.join(ws, "hdf5s/waveforms/eval.h5"))
    # every rank draws its own balanced stream; no DistributedSampler needed for an endless sampler
    batch_sampler = BalancedBatchSampler(train_set.targets, args.batch_size, seed=1234 + rank)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, num_workers=args.workers, pin_memory=True)
    eval_loader = DataLoader(eval_set, batch_size=32, sampler=range(rank, len(eval_set), world),
                             num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Cnn14AttSED()).to(device)
    model = DDP(model, device_ids=[local_rank])
    frontend = Frontend().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world * args.batch_size * args.accum / 512,
                           betas=(0.9, 0.999), eps=1e-8, amsgrad=True)

    ckpt_dir = os.path.join(ws, "checkpoints", "Cnn14AttSED", f"world{world}_bs{args.batch_size}x{args.accum}")
    iteration = 0
    if args.resume_iteration:
        ckpt = torch.load(os.path.join(ckpt_dir, f"{args.resume_iteration}_iterations.pth"), map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        iteration = ckpt["iteration"]
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    loader_iter = iter(train_loader)
    t0 = time.time()
    model.train()
    while iteration < args.iterations:
        opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            wav, y = next(loader_iter)
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = pairwise_mixup(frontend(wav, augment=True), y, rs)
            sync = contextlib.nullcontext() if micro == args.accum - 1 else model.no_sync()
            with sync:
                clipwise, _ = model(x)
                loss = F.binary_cross_entropy(clipwise, y) / args.accum
                loss.backward()
        opt.step()
        iteration += 1

        if iteration % 200 == 0:
            loss_avg = loss.detach() * args.accum
            dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
            log.info("it %d loss %.4f (%.2fs/200 it)", iteration, loss_avg.item(), time.time() - t0)
            t0 = time.time()
        if iteration % args.eval_every == 0 or iteration == args.iterations:
            mAP, auc, dprime = evaluate(model.module, frontend, eval_loader, device)
            log.info("it %d eval mAP %.4f AUC %.4f d' %.3f", iteration, mAP, auc, dprime)
            if rank == 0:
                torch.save({"iteration": iteration, "model": model.module.state_dict(),
                            "optimizer": opt.state_dict()}, os.path.join(ckpt_dir, f"{iteration}_iterations.pth"))
            dist.barrier()
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

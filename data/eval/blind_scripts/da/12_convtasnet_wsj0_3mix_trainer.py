"""Conv-TasNet for 3-speaker separation (wsj0-3mix, 8 kHz min).

    torchrun --standalone --nproc_per_node=4 12_convtasnet_wsj0_3mix_trainer.py \
        --data_dir /data/wsj0-3mix/wav8k/min --exp_dir exp/tasnet3mix
Re-running the same command resumes from exp_dir/checkpoint.pth.
"""
import argparse
import itertools
import logging
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("tasnet3mix")


class MixDataset(Dataset):
    def __init__(self, split_dir, n_src=3, segment_samples=None):
        self.split_dir, self.n_src, self.seg = split_dir, n_src, segment_samples
        self.ids = sorted(os.listdir(os.path.join(split_dir, "mix")))
        if segment_samples:
            self.ids = [i for i in self.ids if sf.info(os.path.join(split_dir, "mix", i)).frames >= segment_samples]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, k):
        uid = self.ids[k]
        paths = [os.path.join(self.split_dir, "mix", uid)] + \
                [os.path.join(self.split_dir, f"s{j + 1}", uid) for j in range(self.n_src)]
        if self.seg:
            total = sf.info(paths[0]).frames
            start = random.randint(0, total - self.seg)
            sigs = [sf.read(p, start=start, frames=self.seg, dtype="float32")[0] for p in paths]
        else:
            sigs = [sf.read(p, dtype="float32")[0] for p in paths]
        return torch.from_numpy(sigs[0]), torch.from_numpy(np.stack(sigs[1:]))


class gLN(nn.GroupNorm):
    def __init__(self, ch):
        super().__init__(1, ch, eps=1e-8)


class DepthConvBlock(nn.Module):
    def __init__(self, B, H, P, dilation, has_res):
        super().__init__()
        self.conv_in = nn.Sequential(nn.Conv1d(B, H, 1), nn.PReLU(), gLN(H))
        self.dconv = nn.Sequential(nn.Conv1d(H, H, P, dilation=dilation, padding=dilation * (P - 1) // 2, groups=H),
                                   nn.PReLU(), gLN(H))
        self.res = nn.Conv1d(H, B, 1) if has_res else None
        self.skip = nn.Conv1d(H, B, 1)

    def forward(self, x):
        y = self.dconv(self.conv_in(x))
        out = x + self.res(y) if self.res is not None else x
        return out, self.skip(y)


class ConvTasNet(nn.Module):
    def __init__(self, n_src=3, N=512, L=16, B=128, H=512, P=3, X=8, R=3):
        super().__init__()
        self.n_src, self.N = n_src, N
        self.encoder = nn.Conv1d(1, N, L, stride=L // 2, bias=False)
        self.norm = gLN(N)
        self.bottleneck = nn.Conv1d(N, B, 1)
        self.blocks = nn.ModuleList([DepthConvBlock(B, H, P, 2 ** (i % X), has_res=i != X * R - 1)
                                     for i in range(X * R)])
        self.mask_out = nn.Sequential(nn.PReLU(), nn.Conv1d(B, n_src * N, 1), nn.ReLU())
        self.decoder = nn.ConvTranspose1d(N, 1, L, stride=L // 2, bias=False)

    def forward(self, mix):
        T = mix.shape[-1]
        rep = F.relu(self.encoder(mix[:, None]))
        x = self.bottleneck(self.norm(rep))
        skips = []
        for blk in self.blocks:
            x, s = blk(x)
            skips.append(s)
        masks = self.mask_out(torch.stack(skips).sum(0)).view(mix.size(0), self.n_src, self.N, -1)
        est = self.decoder((rep[:, None] * masks).reshape(-1, self.N, rep.size(-1)))
        est = est.view(mix.size(0), self.n_src, -1)
        return F.pad(est, (0, max(0, T - est.size(-1))))[..., :T]


def si_snr(e, r, eps=1e-8):
    e, r = e - e.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    s = (e * r).sum(-1, keepdim=True) * r / (r.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((e - s).pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    n = est.size(1)
    pw = si_snr(est[:, :, None], ref[:, None])
    ar = torch.arange(n, device=est.device)
    return torch.stack([pw[:, ar, list(p)].mean(-1) for p in itertools.permutations(range(n))], -1).amax(-1)


class Trainer:
    def __init__(self, args, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        seg = int(args.segment * 8000)
        self.train_set = MixDataset(os.path.join(args.data_dir, "tr"), segment_samples=seg)
        self.cv_set = MixDataset(os.path.join(args.data_dir, "cv"))
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.train_dl = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                   num_workers=args.workers, pin_memory=True, drop_last=True)
        self.cv_dl = DataLoader(Subset(self.cv_set, range(rank, len(self.cv_set), world)), batch_size=1,
                                num_workers=2)
        self.model = DDP(ConvTasNet().to(device), device_ids=[device.index])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, mode="max", factor=0.5, patience=3)
        self.epoch, self.best = 0, -float("inf")
        self.ckpt_path = os.path.join(args.exp_dir, "checkpoint.pth")
        self.best_path = os.path.join(args.exp_dir, "best_model.pth")

    def save(self, is_best):
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                 "sched": self.sched.state_dict(), "epoch": self.epoch, "best": self.best}
        torch.save(state, self.ckpt_path)
        if is_best:
            torch.save(self.model.state_dict(), self.best_path)

    def maybe_resume(self):
        if not os.path.exists(self.ckpt_path):
            return
        state = torch.load(self.ckpt_path, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.epoch, self.best = state["epoch"] + 1, state["best"]
        LOG.info("resumed at epoch %d (best %.2f)", self.epoch, self.best)

    def train_epoch(self):
        self.model.train()
        self.sampler.set_epoch(self.epoch)
        tot = torch.zeros(2, device=self.device)
        for mix, srcs in self.train_dl:
            mix, srcs = mix.to(self.device, non_blocking=True), srcs.to(self.device, non_blocking=True)
            loss = -pit_si_snr(self.model(mix), srcs).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def sisnri(self, net, loader):
        net.eval()
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        for mix, srcs in loader:
            mix, srcs = mix.to(self.device), srcs.to(self.device)
            gain = pit_si_snr(net(mix), srcs) - pit_si_snr(mix[:, None].expand_as(srcs), srcs)
            acc += torch.stack([gain.sum().double(), torch.ones((), device=self.device, dtype=torch.float64)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    def fit(self):
        self.maybe_resume()
        while self.epoch < self.args.epochs:
            tr_loss = self.train_epoch()
            cv = self.sisnri(self.model.module, self.cv_dl)
            self.sched.step(cv)
            is_best = cv > self.best
            self.best = max(cv, self.best)
            LOG.info("epoch %d  train %.3f  cv SI-SNRi %.2f  lr %.1e", self.epoch, tr_loss, cv,
                     self.opt.param_groups[0]["lr"])
            if self.rank == 0:
                self.save(is_best)
            dist.barrier()
            self.epoch += 1

    def test(self):
        tt = MixDataset(os.path.join(self.args.data_dir, "tt"))
        tt_dl = DataLoader(Subset(tt, range(self.rank, len(tt), self.world)), batch_size=1, num_workers=2)
        net = ConvTasNet().to(self.device)
        net.load_state_dict(torch.load(self.best_path, map_location=self.device))
        score = self.sisnri(net, tt_dl)
        LOG.info("tt SI-SNRi: %.2f dB", score)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--exp_dir", default="exp/tasnet3mix")
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch_size", type=int, default=3)
    ap.add_argument("--segment", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)

    trainer = Trainer(args, rank, world, torch.device("cuda", local_rank))
    trainer.fit()
    trainer.test()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

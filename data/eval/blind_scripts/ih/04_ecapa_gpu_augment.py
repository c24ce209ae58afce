"""ECAPA-TDNN training with on-GPU MUSAN / RIR augmentation.

Augmentation runs on the GPU on whole batches (noise and reverb banks are
kept in GPU memory), which keeps the dataloader workers cheap.

Usage:
    torchrun --standalone --nproc_per_node=8 04_ecapa_gpu_augment.py --conf conf/ecapa_aug.yaml
"""
import argparse
import logging
import os
import random
import sys
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from models.ecapa import ECAPA_TDNN
from models.losses import AAMSoftmax
from utils.metrics import compute_eer, compute_min_dcf

logger = logging.getLogger(__name__)


def read_list(path):
    with open(path) as f:
        return [l.strip() for l in f if l.strip()]


def load_fixed(path, n):
    x, _ = sf.read(path, dtype="float32", frames=n)
    if x.ndim > 1:
        x = x[:, 0]
    if len(x) < n:
        x = np.pad(x, (0, n - len(x)), mode="wrap")
    return torch.from_numpy(x)


class GpuAugment:
    """Batch-wise additive noise (MUSAN) + simulated reverberation (RIRs)."""

    def __init__(self, noise_list, rir_list, seg_len, device="cuda:0", max_noises=3000,
                 snr_range=(0.0, 15.0), noise_prob=0.6, rir_prob=0.4, rir_len=8000):
        self.device = torch.device(device)
        self.snr_range = snr_range
        self.noise_prob, self.rir_prob = noise_prob, rir_prob
        noises = read_list(noise_list)
        random.Random(0).shuffle(noises)
        self.noise_bank = torch.stack([load_fixed(p, seg_len) for p in noises[:max_noises]]).to(self.device)
        rirs = []
        for p in read_list(rir_list):
            r = load_fixed(p, rir_len)
            rirs.append(r / (r.norm() + 1e-8))
        self.rir_bank = torch.stack(rirs).to(self.device)

    @torch.no_grad()
    def __call__(self, wav):
        B, T = wav.shape
        out = wav.clone()
        rev = torch.rand(B, device=wav.device) < self.rir_prob
        if rev.any():
            idx = torch.randint(len(self.rir_bank), (int(rev.sum()),))
            y = torchaudio.functional.fftconvolve(out[rev], self.rir_bank[idx])[:, :T]
            # keep the energy of the dry signal
            y = y * (out[rev].norm(dim=1, keepdim=True) / (y.norm(dim=1, keepdim=True) + 1e-8))
            out[rev] = y
        noisy = torch.rand(B, device=wav.device) < self.noise_prob
        if noisy.any():
            k = int(noisy.sum())
            noise = self.noise_bank[torch.randint(len(self.noise_bank), (k,))][:, :T]
            snr = torch.empty(k, 1, device=wav.device).uniform_(*self.snr_range)
            p_s = out[noisy].pow(2).mean(1, keepdim=True)
            p_n = noise.pow(2).mean(1, keepdim=True) + 1e-8
            out[noisy] = out[noisy] + noise * torch.sqrt(p_s / (p_n * 10 ** (snr / 10)))
        return out


class SpeakerModel(torch.nn.Module):
    def __init__(self, encoder, head):
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, wav, label):
        return self.head(self.encoder(wav), label)


class SegmentDataset(Dataset):
    def __init__(self, utt_list, spk2id_file, seg_len):
        with open(spk2id_file) as f:
            self.spk2id = {k: int(v) for k, v in (l.split() for l in f)}
        self.utts = []
        for line in read_list(utt_list):
            path = line.split()[0]
            spk = path.split("/")[-3]
            self.utts.append((path, self.spk2id[spk]))
        self.seg_len = seg_len

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        path, label = self.utts[i]
        n = sf.info(path).frames
        start = random.randint(0, max(0, n - self.seg_len))
        return load_fixed_from(path, start, self.seg_len), label


def load_fixed_from(path, start, n):
    x, _ = sf.read(path, start=start, frames=n, dtype="float32")
    if len(x) < n:
        x = np.pad(x, (0, n - len(x)), mode="wrap")
    return torch.from_numpy(x)


@torch.no_grad()
def run_eval(encoder, trial_file, wav_dir, device, rank, world):
    encoder.eval()
    trials = [l.split() for l in read_list(trial_file)]
    utts = sorted({t[1] for t in trials} | {t[2] for t in trials})
    mine = {}
    for u in utts[rank::world]:
        x, _ = sf.read(os.path.join(wav_dir, u), dtype="float32")
        e = encoder(torch.from_numpy(x)[None].to(device))
        mine[u] = F.normalize(e, dim=-1)[0].cpu()
    every = [None] * world
    dist.all_gather_object(every, mine)
    emb = {k: v for d in every for k, v in d.items()}
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([int(t[0]) for t in trials])
    return compute_eer(scores, labels), compute_min_dcf(scores, labels, p_target=0.01)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--conf", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    with open(args.conf) as f:
        conf = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    seg_len = int(conf["seg_sec"] * 16000)
    dataset = SegmentDataset(conf["train_list"], conf["spk2id"], seg_len)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    per_gpu = conf["batch_size"] // world
    loader = DataLoader(dataset, batch_size=per_gpu, sampler=sampler, num_workers=conf.get("workers", 6),
                        pin_memory=True, drop_last=True, persistent_workers=True)
    augment = GpuAugment(conf["musan_list"], conf["rir_list"], seg_len)

    encoder = ECAPA_TDNN(in_dim=80, channels=conf["channels"], emb_dim=conf["emb_dim"])
    head = AAMSoftmax(conf["emb_dim"], len(dataset.spk2id), margin=conf["margin"], scale=conf["scale"])
    model = SpeakerModel(encoder, head).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(ddp.parameters(), lr=conf["lr"], weight_decay=conf["weight_decay"])
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=conf["min_lr"], max_lr=conf["lr"],
                                              step_size_up=conf["cycle_steps"] // 2, mode="triangular2",
                                              cycle_momentum=False)

    out_dir = conf["exp_dir"]
    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(out_dir, "tb"))
    start_epoch = 0
    if args.resume and os.path.exists(os.path.join(out_dir, "last.pt")):
        state = torch.load(os.path.join(out_dir, "last.pt"), map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, conf["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for step, (wav, y) in enumerate(loader):
            wav = augment(wav.to(device, non_blocking=True))
            y = y.to(device, non_blocking=True)
            loss, acc = ddp(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            meter += torch.stack([loss.detach(), acc.detach()])
            if (step + 1) % 100 == 0:
                dist.all_reduce(meter)
                meter /= (100 * world)
                gstep = epoch * len(loader) + step
                if rank == 0:
                    logger.info("epoch %d step %d loss %.4f acc %.3f (%.1fs)", epoch, step + 1,
                                meter[0].item(), meter[1].item(), time.time() - t0)
                    writer.add_scalar("train/loss", meter[0].item(), gstep)
                    writer.add_scalar("train/acc", meter[1].item(), gstep)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)
                meter.zero_()

        eer, dcf = run_eval(ddp.module.encoder, conf["trials"], conf["eval_wav_dir"], device, rank, world)
        if rank == 0:
            logger.info("epoch %d EER %.3f minDCF %.4f", epoch, eer, dcf)
            writer.add_scalar("eval/eer", eer, epoch)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(out_dir, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

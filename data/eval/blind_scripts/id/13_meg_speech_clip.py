"""Contrastive decoding of perceived speech from MEG (brain <-> wav2vec2 latents).

3-s MEG segments (208 sensors, 120 Hz) are aligned with frozen wav2vec2-large
features of the audio the participant heard (precomputed, 50 Hz, layer 18
average).  A brain encoder with a per-subject layer is trained with a CLIP
loss; evaluation is segment-level top-10 retrieval among all test segments.

    torchrun --nproc_per_node=4 13_meg_speech_clip.py --data /data/gwilliams2022/segments
"""
import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm


class SegmentDataset(Dataset):
    def __init__(self, root, split):
        d = np.load(Path(root) / f"{split}.npz", mmap_mode="r")
        self.meg = d["meg"]            # (N, 208, 360) float16, robust-scaled per subject
        self.audio = d["w2v"]          # (N, 1024, 150) float16
        self.subject = d["subject"]    # (N,) int
        self.n_subjects = int(np.load(Path(root) / "train.npz")["subject"].max()) + 1

    def __len__(self):
        return len(self.subject)

    def __getitem__(self, i):
        return (torch.from_numpy(np.asarray(self.meg[i], dtype=np.float32)),
                torch.from_numpy(np.asarray(self.audio[i], dtype=np.float32)),
                int(self.subject[i]))


class SubjectLayer(nn.Module):
    def __init__(self, n_subjects, ch_in, ch_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_subjects, ch_in, ch_out) / ch_in ** 0.5)

    def forward(self, x, subject):  # x: (B, C, T)
        return torch.einsum("bct,bcd->bdt", x, self.weight[subject])


class BrainEncoder(nn.Module):
    def __init__(self, n_subjects, n_sensors=208, hidden=320, out_dim=1024, depth=5):
        super().__init__()
        self.spatial = nn.Conv1d(n_sensors, 270, 1)
        self.subject_layer = SubjectLayer(n_subjects, 270, 270)
        convs = []
        ch = 270
        for k in range(depth):
            d = 2 ** (2 * k % 5)
            convs += [nn.Conv1d(ch, hidden, 3, padding=d, dilation=d), nn.BatchNorm1d(hidden), nn.GELU()]
            ch = hidden
        self.convs = nn.Sequential(*convs)
        # 120 Hz MEG -> 50 Hz w2v frames
        self.resample = nn.Upsample(size=150, mode="linear", align_corners=False)
        self.proj = nn.Conv1d(hidden, out_dim, 1)

    def forward(self, meg, subject):
        h = self.subject_layer(self.spatial(meg), subject)
        return self.proj(self.resample(self.convs(h)))


class BrainSpeechCLIP(nn.Module):
    def __init__(self, n_subjects):
        super().__init__()
        self.brain = BrainEncoder(n_subjects)
        self.logit_scale = nn.Parameter(torch.tensor(np.log(1 / 0.07), dtype=torch.float32))

    def encode_brain(self, meg, subject):
        z = self.brain(meg, subject)
        return F.normalize(z.flatten(1), dim=-1)

    def forward(self, meg, audio, subject):
        zb = self.encode_brain(meg, subject)
        za = F.normalize(audio.flatten(1), dim=-1)
        return zb, za, self.logit_scale.exp().clamp(max=100)


def gather_with_grad(x):
    """All-gather that keeps the gradient for the local slice."""
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


def clip_loss(zb, za, scale):
    zb_all, za_all = gather_with_grad(zb), gather_with_grad(za)
    logits = scale * zb_all @ za_all.t()
    labels = torch.arange(len(logits), device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


@torch.no_grad()
def retrieval_topk(model, loader, device, k=10):
    model.eval()
    zb_l, za_l = [], []
    for meg, audio, subj in loader:
        zb_l.append(model.encode_brain(meg.to(device), subj.to(device)))
        za_l.append(F.normalize(audio.to(device).flatten(1), dim=-1))
    zb, za = torch.cat(zb_l), torch.cat(za_l)
    sims = zb @ za.t()
    ranks = (sims > sims.diag()[:, None]).sum(1)
    return (ranks < k).float().mean().item(), ranks.float().median().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", default="ckpt/meg_clip")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, test_ds = SegmentDataset(args.data, "train"), SegmentDataset(args.data, "test")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, 256, shuffle=False, num_workers=4, pin_memory=True)

    model = BrainSpeechCLIP(train_ds.n_subjects)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_top10 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        it = tqdm(train_dl, disable=rank != 0, desc=f"epoch {epoch}")
        for meg, audio, subj in it:
            meg, audio, subj = meg.to(device, non_blocking=True), audio.to(device, non_blocking=True), subj.to(device)
            zb, za, scale = model(meg, audio, subj)
            loss = clip_loss(zb, za, scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it.set_postfix(loss=f"{loss.item():.3f}", scale=f"{scale.item():.1f}")

        if rank == 0:
            top10, med_rank = retrieval_topk(model, test_dl, device)
            print(f"epoch {epoch}: test top-10 acc {top10:.4f}, median rank {med_rank:.0f} / {len(test_ds)}")
            if top10 > best_top10:
                best_top10 = top10
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

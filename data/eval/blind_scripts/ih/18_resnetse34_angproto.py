"""ResNetSE34V2 trained with softmax-proto (AM-softmax + angular prototypical) loss,
in the style of voxceleb_trainer. Each mini-batch holds `n_per_spk` utterances
of every speaker in it; the speaker-balanced sampler below shards one global
epoch permutation across ranks.

    torchrun --nproc_per_node=8 18_resnetse34_angproto.py --train-list lists/train_list.txt \
        --train-path /data/voxceleb2 --test-list lists/veri_test2.txt --test-path /data/voxceleb1
"""
import argparse
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

from models.ResNetSE34V2 import MainModel as ResNetSE34V2
from tuneThreshold import ComputeErrorRates, ComputeMinDcf, tuneThresholdfromScore


def load_wav(path, max_frames, evalmode=False, num_eval=10):
    max_audio = max_frames * 160 + 240
    audio, _ = sf.read(path, dtype="float32")
    if audio.shape[0] <= max_audio:
        audio = np.pad(audio, (0, max_audio - audio.shape[0] + 1), "wrap")
    if evalmode:
        starts = np.linspace(0, audio.shape[0] - max_audio, num=num_eval).astype(int)
    else:
        starts = [random.randint(0, audio.shape[0] - max_audio)]
    return np.stack([audio[s:s + max_audio] for s in starts])


class TrainSet(Dataset):
    def __init__(self, list_file, root, max_frames):
        lines = [l.split() for l in open(list_file)]
        speakers = sorted({l[0] for l in lines})
        self.spk2id = {s: i for i, s in enumerate(speakers)}
        self.files = [os.path.join(root, l[1]) for l in lines]
        self.labels = [self.spk2id[l[0]] for l in lines]
        self.max_frames = max_frames

    def __len__(self):
        return len(self.files)

    def __getitem__(self, indices):
        feats = [load_wav(self.files[i], self.max_frames) for i in indices]
        return torch.from_numpy(np.concatenate(feats)), self.labels[indices[0]]


class DistributedSpeakerSampler(Sampler):
    """Yields groups of `n_per_spk` indices of one speaker; a batch never holds a speaker twice."""

    def __init__(self, labels, n_per_spk, batch_size, max_seg_per_spk, rank, world, seed=0):
        self.labels, self.n_per_spk, self.batch_size = labels, n_per_spk, batch_size
        self.max_seg = max_seg_per_spk
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _groups(self):
        rng = np.random.default_rng(self.seed + self.epoch)  # identical on all ranks
        by_spk = {}
        for idx, lab in enumerate(self.labels):
            by_spk.setdefault(lab, []).append(idx)
        groups, group_spk = [], []
        for spk in sorted(by_spk):
            idx = rng.permutation(by_spk[spk])[: self.max_seg]
            for j in range(0, len(idx) - self.n_per_spk + 1, self.n_per_spk):
                groups.append(list(idx[j:j + self.n_per_spk]))
                group_spk.append(spk)
        order = rng.permutation(len(groups))
        batches, cur, seen = [], [], set()
        for o in order:  # greedy: skip a group whose speaker is already in the current batch
            if group_spk[o] in seen:
                continue
            cur.append(groups[o])
            seen.add(group_spk[o])
            if len(cur) == self.batch_size:
                batches.append(cur)
                cur, seen = [], set()
        usable = len(batches) - len(batches) % self.world
        return [g for b in batches[:usable][self.rank::self.world] for g in b]

    def __iter__(self):
        return iter(self._groups())

    def __len__(self):
        return len(self._groups())


class SoftmaxProto(nn.Module):
    def __init__(self, n_out, n_classes, margin=0.1, scale=30.0):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_out, n_classes) * 0.01)
        self.m, self.s = margin, scale
        self.w = nn.Parameter(torch.tensor(10.0))
        self.b = nn.Parameter(torch.tensor(-5.0))

    def forward(self, x, label):  # x: (B, n_per_spk, D)
        flat = x.reshape(-1, x.size(-1))
        lab = label.repeat_interleave(x.size(1))
        cos = F.normalize(flat, dim=1) @ F.normalize(self.W, dim=0)
        am = F.cross_entropy(self.s * (cos - self.m * F.one_hot(lab, cos.size(1))), lab)
        anchor, positive = x[:, 1:, :].mean(1), x[:, 0, :]
        sim = F.cosine_similarity(positive.unsqueeze(-1), anchor.unsqueeze(-1).transpose(0, 2))
        self.w.data.clamp_(min=1e-6)
        ap = F.cross_entropy(sim * self.w + self.b, torch.arange(x.size(0), device=x.device))
        return am + ap


class SpeakerNet(nn.Module):
    def __init__(self, n_classes, n_out=512):
        super().__init__()
        self.encoder = ResNetSE34V2(nOut=n_out, encoder_type="ASP", log_input=True)
        self.loss = SoftmaxProto(n_out, n_classes)

    def extract_embedding(self, wav):
        return self.encoder(wav)

    def forward(self, wav, label):  # wav: (B, n_per_spk, T)
        B, M, T = wav.shape
        emb = self.encoder(wav.reshape(B * M, T)).reshape(B, M, -1)
        return self.loss(emb, label)


@torch.no_grad()
def evaluate(model, test_list, test_path, eval_frames, device, rank, world):
    model.eval()
    lines = [l.split() for l in open(test_list)]
    files = sorted({f for l in lines for f in l[1:]})
    feats = {}
    for f in files[rank::world]:
        x = torch.from_numpy(load_wav(os.path.join(test_path, f), eval_frames, evalmode=True)).to(device)
        feats[f] = F.normalize(model.extract_embedding(x), dim=1).cpu()
    parts = [None] * world
    dist.all_gather_object(parts, feats)
    if rank != 0:
        return None
    for p in parts:
        feats.update(p)
    scores = [torch.matmul(feats[a], feats[b].T).mean().item() for _, a, b in lines]
    labels = [int(l[0]) for l in lines]
    eer = tuneThresholdfromScore(scores, labels, [1, 0.1])[1]
    fnrs, fprs, thr = ComputeErrorRates(scores, labels)
    mindcf, _ = ComputeMinDcf(fnrs, fprs, thr, 0.05, 1, 1)
    return eer, mindcf


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-list", required=True)
    p.add_argument("--train-path", required=True)
    p.add_argument("--test-list", required=True)
    p.add_argument("--test-path", required=True)
    p.add_argument("--save-path", default="exps/resnetse34v2_sp")
    p.add_argument("--max-frames", type=int, default=200)
    p.add_argument("--eval-frames", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=400, help="speakers per batch, all GPUs together")
    p.add_argument("--n-per-spk", type=int, default=2)
    p.add_argument("--max-seg-per-spk", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-decay", type=float, default=0.95)
    p.add_argument("--max-epoch", type=int, default=100)
    p.add_argument("--test-interval", type=int, default=10)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = TrainSet(args.train_list, args.train_path, args.max_frames)
    per_gpu = args.batch_size // world
    sampler = DistributedSpeakerSampler(train_set.labels, args.n_per_spk, per_gpu,
                                        args.max_seg_per_spk, rank, world)
    loader = DataLoader(train_set, batch_size=per_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    model = SpeakerNet(len(train_set.spk2id)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=args.lr_decay)
    if rank == 0:
        os.makedirs(os.path.join(args.save_path, "model"), exist_ok=True)
        scorefile = open(os.path.join(args.save_path, "scores.txt"), "a")

    for epoch in range(1, args.max_epoch + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for wav, label in loader:
            wav, label = wav.to(device, non_blocking=True), label.to(device, non_blocking=True)
            loss = model(wav, label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {stats[0] / stats[1]:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)

        if epoch % args.test_interval == 0:
            res = evaluate(model, args.test_list, args.test_path, args.eval_frames, device, rank, world)
            if rank == 0:
                print(f"epoch {epoch} VEER {res[0]:.4f} MinDCF {res[1]:.5f}", flush=True)
                scorefile.write(f"epoch {epoch}, VEER {res[0]:.4f}, MinDCF {res[1]:.5f}\n")
                scorefile.flush()
                torch.save(model.module.state_dict(),
                           os.path.join(args.save_path, "model", f"model{epoch:09d}.model"))
        dist.barrier()

    if rank == 0:
        scorefile.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

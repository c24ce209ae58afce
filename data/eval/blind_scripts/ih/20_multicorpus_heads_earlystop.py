"""Joint VoxCeleb2 + CN-Celeb training with one AAM head per corpus.

The two corpora have disjoint speaker sets, so each keeps its own classifier;
every mini-batch comes from a single corpus and only that corpus' head is used.
Early stopping on Vox1-O EER (patience in evaluations).

    torchrun --nproc_per_node=8 20_multicorpus_heads_earlystop.py --config conf/joint.yaml
"""
import argparse
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

from sv.model import ECAPATDNN
from sv.metrics import eer_mindcf


class AAM(nn.Module):
    def __init__(self, dim, n_cls, m=0.2, s=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_cls, dim))
        nn.init.xavier_normal_(self.weight)
        self.m, self.s = m, s

    def forward(self, x, y):
        cos = F.linear(F.normalize(x), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        logits = self.s * torch.where(F.one_hot(y, cos.size(1)).bool(), torch.cos(torch.acos(cos) + self.m), cos)
        return F.cross_entropy(logits, y)


class JointModel(nn.Module):
    def __init__(self, n_spk_per_corpus, emb_dim=192):
        super().__init__()
        self.encoder = ECAPATDNN(C=1024, emb_dim=emb_dim)
        self.heads = nn.ModuleDict({name: AAM(emb_dim, n) for name, n in n_spk_per_corpus.items()})

    def extract(self, wav):
        return self.encoder(wav)

    def forward(self, wav, y, corpus):
        return self.heads[corpus](self.encoder(wav), y)


class MultiCorpus(Dataset):
    def __init__(self, lists, seconds):
        self.items, self.n_spk, self.corpus_of = [], {}, []
        for name in sorted(lists):
            rows = [l.split() for l in open(lists[name])]  # path speaker
            spk2id = {s: i for i, s in enumerate(sorted({r[1] for r in rows}))}
            self.n_spk[name] = len(spk2id)
            for path, spk in rows:
                self.items.append((path, spk2id[spk]))
                self.corpus_of.append(name)
        self.n = int(seconds * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        frames = sf.info(path).frames
        off = random.randint(0, max(0, frames - self.n))
        wav, _ = sf.read(path, start=off, frames=self.n, dtype="float32")
        if len(wav) < self.n:
            wav = np.pad(wav, (0, self.n - len(wav)), mode="wrap")
        return torch.from_numpy(wav), y, self.corpus_of[i]


class CorpusBatchSampler(Sampler):
    """Single-corpus batches. Every rank gets the same number of batches of every corpus."""

    def __init__(self, corpus_of, batch_size, rank, world, seed=0):
        self.by_corpus = {}
        for i, c in enumerate(corpus_of):
            self.by_corpus.setdefault(c, []).append(i)
        self.bs, self.rank, self.world, self.seed, self.epoch = batch_size, rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _per_rank(self, idx):
        return len(idx) // self.world // self.bs

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = []
        for c in sorted(self.by_corpus):
            idx = self.by_corpus[c]
            perm = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
            n_b = self._per_rank(idx)
            mine = perm[self.rank::self.world][: n_b * self.bs]
            batches += [mine[k * self.bs:(k + 1) * self.bs] for k in range(n_b)]
        random.Random(self.seed * 1000 + self.epoch * 10 + self.rank).shuffle(batches)
        return iter(batches)

    def __len__(self):
        return sum(self._per_rank(idx) for idx in self.by_corpus.values())


def collate(batch):
    wav, y, corpus = zip(*batch)
    assert len(set(corpus)) == 1
    return torch.stack(wav), torch.tensor(y), corpus[0]


@torch.no_grad()
def vox1_eval(model, cfg, device, rank, world):
    model.eval()
    trials = [l.split() for l in open(cfg["trials"])]
    utts = sorted({u for t in trials for u in t[1:]})
    mine = {}
    for u in utts[rank::world]:
        wav, _ = sf.read(os.path.join(cfg["vox1_root"], u), dtype="float32")
        mine[u] = F.normalize(model.extract(torch.from_numpy(wav)[None].to(device)), dim=-1)[0].cpu()
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    emb = {k: v for p in parts for k, v in p.items()}
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    return eer_mindcf(scores, np.array([int(t[0]) for t in trials]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = MultiCorpus(cfg["train_lists"], cfg["seconds"])
    per_gpu = cfg["global_batch"] // world
    sampler = CorpusBatchSampler(data.corpus_of, per_gpu, rank, world, seed=cfg["seed"])
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=8, pin_memory=True)

    model = JointModel(data.n_spk).to(device)
    # in a given step the ranks may hold batches of different corpora: the other head gets no gradient
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"], weight_decay=2e-5)
    total = cfg["epochs"] * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg["warmup_steps"]) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    ckpt_path = os.path.join(cfg["exp_dir"], "last.pt")
    start, best, bad_evals = 0, float("inf"), 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best, bad_evals = ck["epoch"] + 1, ck["best"], ck["bad_evals"]
    if rank == 0:
        os.makedirs(cfg["exp_dir"], exist_ok=True)
        print(f"speakers per corpus {data.n_spk}, {len(loader)} batches/epoch/rank", flush=True)

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        losses = torch.zeros(2, device=device)
        for wav, y, corpus in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = ddp(wav, y, corpus)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(losses)

        eer, dcf = vox1_eval(model, cfg, device, rank, world)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            print(f"epoch {epoch} loss {losses[0] / losses[1]:.4f} Vox1-O EER {eer:.3f}% minDCF {dcf:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if eer < best:
                best, bad_evals = eer, 0
                torch.save(model.encoder.state_dict(), os.path.join(cfg["exp_dir"], "best_encoder.pt"))
            else:
                bad_evals += 1
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best, "bad_evals": bad_evals}, ckpt_path)
            stop[0] = float(bad_evals >= cfg["patience"])
        dist.broadcast(stop, src=0)
        if stop.item():
            if rank == 0:
                print(f"early stop at epoch {epoch}, best EER {best:.3f}%", flush=True)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

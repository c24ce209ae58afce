"""Clip-caption retrieval on YouCook2 with MIL-NCE.

Each training clip has its own caption plus the ASR narrations that overlap it
(a bag of positives); negatives are all other clips' texts in the global batch.
Video features: S3D (HowTo100M MIL-NCE) mixed_5c, 1 feature per 16 frames,
variable number per clip. Text: word2vec-initialised bag-of-words encoder.

    torchrun --nproc_per_node=4 20_youcook2_milnce_finetune.py --root /data/youcook2
"""
import argparse
import json
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_POS = 4      # caption + up to 3 narrations
MAX_WORDS = 20
MAX_FEATS = 48


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--batch-size", type=int, default=256, help="clips per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--logdir", default="runs/yc2_milnce")
    return p.parse_args()


def tokenize(text, vocab):
    words = re.findall(r"[a-z']+", text.lower())[:MAX_WORDS]
    ids = [vocab[w] for w in words if w in vocab]
    out = np.zeros(MAX_WORDS, dtype=np.int64)
    out[: len(ids)] = ids
    return out


class YC2Clips(Dataset):
    def __init__(self, root, split, vocab, train):
        with open(os.path.join(root, f"{split}_clips.json")) as f:
            self.clips = json.load(f)  # [{"id", "feat", "caption", "narrations": [...]}]
        self.root, self.vocab, self.train = root, vocab, train

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        c = self.clips[i]
        f = np.load(os.path.join(self.root, "s3d_feats", c["feat"]))  # n x 1024
        n = len(f)
        if n > MAX_FEATS:
            idx = np.linspace(0, n - 1, MAX_FEATS).astype(int)
            f, n = f[idx], MAX_FEATS
        feats = np.zeros((MAX_FEATS, 1024), dtype=np.float32)
        feats[:n] = f
        texts = [c["caption"]]
        if self.train:
            narr = list(c.get("narrations", []))
            np.random.shuffle(narr)
            texts += narr[: N_POS - 1]
        toks = np.zeros((N_POS, MAX_WORDS), dtype=np.int64)
        tmask = np.zeros(N_POS, dtype=bool)
        for k, t in enumerate(texts):
            toks[k] = tokenize(t, self.vocab)
            tmask[k] = True
        return torch.from_numpy(feats), n, torch.from_numpy(toks), torch.from_numpy(tmask)


class VideoHead(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.gru = nn.GRU(1024, d // 2, batch_first=True, bidirectional=True)
        self.proj = nn.Linear(d, d)

    def forward(self, x, n):
        packed = nn.utils.rnn.pack_padded_sequence(x, n.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.gru(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.size(1))
        m = (torch.arange(x.size(1), device=x.device)[None] < n[:, None]).unsqueeze(-1).float()
        return self.proj((h * m).sum(1) / n[:, None].float())


class TextHead(nn.Module):
    def __init__(self, w2v, d=512):
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(w2v, freeze=False, padding_idx=0)
        self.fc1 = nn.Linear(w2v.size(1), 2048)
        self.fc2 = nn.Linear(2048, d)

    def forward(self, ids):  # ..., MAX_WORDS
        h = F.relu(self.fc1(self.emb(ids)))
        h = h.max(-2)[0]  # max over words
        return self.fc2(h)


class MILNCEModel(nn.Module):
    def __init__(self, w2v):
        super().__init__()
        self.video = VideoHead()
        self.text = TextHead(w2v)

    def forward(self, feats, n, toks):
        b = toks.size(0)
        v = self.video(feats, n)
        t = self.text(toks.flatten(0, 1)).view(b, N_POS, -1)
        return v, t


def milnce_loss(v, t, tmask):
    """v: B x d, t: B x P x d (local). Positives: own texts; negatives: all texts of the global batch."""
    all_t = torch.cat(dnn.all_gather(t), 0)          # W*B x P x d
    all_m = torch.cat(dnn.all_gather(tmask.float()), 0) > 0
    b, w = v.size(0), dist.get_world_size()
    scores = torch.einsum("bd,npd->bnp", v, all_t)    # B x W*B x P
    scores = scores.masked_fill(~all_m[None], float("-inf"))
    own = torch.arange(b, device=v.device) + dist.get_rank() * b
    pos = torch.logsumexp(scores[torch.arange(b), own], dim=-1)
    den = torch.logsumexp(scores.flatten(1), dim=-1)
    return (den - pos).mean()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    V, T = [], []
    for feats, n, toks, _ in loader:
        v, t = net(feats.to(device), n.to(device), toks.to(device))
        V.append(F.normalize(v, dim=-1))
        T.append(F.normalize(t[:, 0], dim=-1))  # the caption only
    sim = torch.cat(T) @ torch.cat(V).t()
    ranks = (sim > sim.diag()[:, None]).sum(1) + 1
    net.train()
    return {f"R@{k}": 100 * (ranks <= k).float().mean().item() for k in (1, 5, 10)} | \
        {"MedR": ranks.float().median().item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    w2v = np.load(os.path.join(args.root, "word2vec_300.npy"))
    with open(os.path.join(args.root, "word2vec_vocab.json")) as f:
        vocab = json.load(f)
    train_set = YC2Clips(args.root, "training", vocab, train=True)
    val_set = YC2Clips(args.root, "validation", vocab, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=512, num_workers=8)

    net = MILNCEModel(torch.from_numpy(w2v).float()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best = 0.0
    for epoch in range(args.epochs):
        t0, tot = time.time(), torch.zeros(2, device=device)
        for feats, n, toks, tmask in train_loader:
            feats, n = feats.to(device, non_blocking=True), n.to(device)
            toks, tmask = toks.to(device, non_blocking=True), tmask.to(device)
            v, t = model(feats, n, toks)
            loss = milnce_loss(v, t, tmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        if rank == 0:
            res = evaluate(net, val_loader, device)
            writer.add_scalar("train/loss", (tot[0] / tot[1]).item(), epoch)
            for k, val in res.items():
                writer.add_scalar(f"val/{k}", val, epoch)
            print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f} val {res} ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.logdir, "last.pt"))
            if res["R@1"] > best:
                best = res["R@1"]
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.logdir, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

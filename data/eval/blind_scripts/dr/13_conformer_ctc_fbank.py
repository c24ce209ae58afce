"""Conformer-CTC (character units) with cached fbank features, length bucketing and SyncBatchNorm.

    torchrun --nproc_per_node=8 13_conformer_ctc_fbank.py --config conf/conformer_l.yaml \
        [--resume exp/conformer_l/last.pt]
"""
import argparse
import datetime
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def compute_fbank_cache(manifest, out_path, n_mels=80):
    """Extract log-mel for every utterance of a manifest into a single .pt file."""
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160, n_mels=n_mels)
    feats, texts, frames = [], [], []
    with open(manifest) as f:
        for line in f:
            r = json.loads(line)
            wav, sr = torchaudio.load(r["audio_filepath"])
            if sr != 16000:
                wav = torchaudio.functional.resample(wav, sr, 16000)
            x = (mel(wav[0]) + 1e-6).log().t().contiguous().half()
            feats.append(x)
            texts.append(r["text"].lower())
            frames.append(x.size(0))
    tmp = out_path + f".tmp{os.getpid()}"
    torch.save({"feats": feats, "texts": texts, "frames": frames}, tmp)
    os.replace(tmp, out_path)


def load_split(manifest, cache_dir, rank):
    path = os.path.join(cache_dir, os.path.basename(manifest).replace(".jsonl", ".fbank.pt"))
    if rank == 0 and not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        compute_fbank_cache(manifest, path)
    dist.barrier()
    # mmap: the 8 ranks (and their loader workers) share one page-cache copy of the features
    return torch.load(path, map_location="cpu", mmap=True)


class FbankDataset(Dataset):
    def __init__(self, split, stoi, specaug=False):
        self.feats, self.texts = split["feats"], split["texts"]
        self.stoi = stoi
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27), torchaudio.transforms.FrequencyMasking(27),
            *[torchaudio.transforms.TimeMasking(100, p=0.05) for _ in range(5)],
        ) if specaug else None

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        x = self.feats[i].float()
        x = (x - x.mean(0)) / (x.std(0) + 1e-5)
        if self.specaug is not None:
            x = self.specaug(x.t()).t()
        y = torch.tensor([self.stoi.get(c, 1) for c in self.texts[i]], dtype=torch.long)
        return x, y, self.texts[i]


def collate(batch):
    xs, ys, txt = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([x.size(0) for x in xs]),
            nn.utils.rnn.pad_sequence(ys, batch_first=True), torch.tensor([y.size(0) for y in ys]), list(txt))


class EqualShardBucketSampler(Sampler):
    def __init__(self, frames, batch_size, rank, world, buckets=40, seed=0):
        self.frames, self.bs = frames, batch_size
        self.rank, self.world, self.buckets = rank, world, buckets
        self.seed, self.epoch = seed, 0

    def set_epoch(self, e):
        self.epoch = e

    def batches(self):
        rnd = random.Random(self.seed * 1000 + self.epoch)
        order = sorted(range(len(self.frames)), key=self.frames.__getitem__)
        per = math.ceil(len(order) / self.buckets)
        out = []
        for s in range(0, len(order), per):
            bucket = order[s:s + per]
            rnd.shuffle(bucket)
            out.extend(bucket[j:j + self.bs] for j in range(0, len(bucket) - self.bs + 1, self.bs))
        rnd.shuffle(out)
        n = len(out) // self.world
        return out[self.rank * n:(self.rank + 1) * n]

    def __iter__(self):
        yield from self.batches()

    def __len__(self):
        return len(self.batches())


class ConvSubsampling(nn.Module):
    def __init__(self, n_mels, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.lin = nn.Linear(d * (((n_mels - 1) // 2 - 1) // 2), d)

    def forward(self, x, n):
        x = self.conv(x.unsqueeze(1))
        return self.lin(x.transpose(1, 2).flatten(2)), ((n - 1) // 2 - 1) // 2


class Model(nn.Module):
    def __init__(self, cfg, n_tokens):
        super().__init__()
        self.sub = ConvSubsampling(cfg.n_mels, cfg.d_model)
        self.conformer = torchaudio.models.Conformer(cfg.d_model, cfg.heads, cfg.ffn, cfg.layers,
                                                     cfg.kernel, dropout=cfg.dropout)
        self.ctc_head = nn.Linear(cfg.d_model, n_tokens)

    def forward(self, x, n):
        x, n = self.sub(x, n)
        x, n = self.conformer(x, n)
        return self.ctc_head(x), n


def edit(r, h):
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        p, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            p, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, p + (r[i - 1] != h[j - 1]))
    return d[-1]


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run extracts features on rank 0 while the others wait in a barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    train = load_split(cfg.train_manifest, cfg.cache_dir, rank)
    dev = load_split(cfg.dev_manifest, cfg.cache_dir, rank)
    chars = sorted(set("".join(train["texts"])))
    itos = ["<blank>", "<unk>"] + chars
    stoi = {c: i for i, c in enumerate(itos)}

    sampler = EqualShardBucketSampler(train["frames"], cfg.batch_size, rank, world, seed=cfg.seed)
    train_dl = DataLoader(FbankDataset(train, stoi, specaug=True), batch_sampler=sampler, collate_fn=collate,
                          num_workers=cfg.num_workers, pin_memory=True)
    dev_ds = FbankDataset(dev, stoi)
    dev_order = sorted(range(len(dev_ds)), key=dev["frames"].__getitem__)[rank::world]
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, dev_order), batch_size=32, collate_fn=collate)

    model = Model(cfg, len(itos))
    # small per-GPU batches of long utterances: normalise the conv-module BatchNorm over all GPUs
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * len(train_dl),
                                                pct_start=0.1, anneal_strategy="cos")
    ctc = nn.CTCLoss(zero_infinity=True)

    start = 0
    if cfg.resume:
        state = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        with open(os.path.join(cfg.exp_dir, "tokens.txt"), "w") as f:
            f.write("\n".join(itos) + "\n")

    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, n, y, m, _) in enumerate(train_dl):
            x, n, y, m = x.to(device), n.to(device), y.to(device), m.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, out_n = model(x, n)
            loss = ctc(logits.float().log_softmax(-1).transpose(0, 1), y, out_n, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if i % 100 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {i}/{len(train_dl)} ctc {avg.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, n, _, _, txt in dev_dl:
                logits, out_n = model.module(x.to(device), n.to(device))
                for k, ids in enumerate(logits.argmax(-1)):
                    ids = torch.unique_consecutive(ids[: out_n[k]]).tolist()
                    hyp = "".join(itos[t] for t in ids if t > 0)
                    acc[0] += edit(txt[k].split(), hyp.split())
                    acc[1] += len(txt[k].split())
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: dev WER {100 * (acc[0] / acc[1]).item():.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(cfg.exp_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

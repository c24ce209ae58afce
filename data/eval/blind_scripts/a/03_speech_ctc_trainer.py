"""Character-level CTC acoustic model (conv front-end + BiLSTM) on LibriSpeech manifests.

Manifest lines: {"audio_filepath": "...flac", "duration": 12.3, "text": "..."}

    torchrun --standalone --nproc_per_node=8 train_ctc.py --config conf/ctc_bilstm.yaml
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}

DEFAULTS = {
    "train_manifest": "manifests/train_960.jsonl",
    "dev_manifest": "manifests/dev_clean.jsonl",
    "exp_dir": "exp/ctc_bilstm",
    "max_duration": 16.7,
    "batch_size": 16,
    "epochs": 60,
    "lr": 1e-3,
    "warmup_steps": 2000,
    "grad_clip": 5.0,
    "n_mels": 80,
    "hidden": 512,
    "layers": 5,
    "num_workers": 6,
    "log_every": 100,
}


class ManifestDataset(Dataset):
    def __init__(self, manifest, n_mels, max_duration):
        self.items = []
        with open(manifest) as f:
            for line in f:
                item = json.loads(line)
                if item["duration"] <= max_duration:
                    self.items.append(item)
        self.fbank = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400,
                                                          hop_length=160, n_mels=n_mels)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        wav, sr = torchaudio.load(item["audio_filepath"])
        assert sr == 16000
        feats = (self.fbank(wav[0]) + 1e-6).log().transpose(0, 1)  # T x F
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        text = item["text"].lower()
        target = torch.tensor([CHAR2ID[c] for c in text if c in CHAR2ID], dtype=torch.long)
        return feats, target


def collate(batch):
    feats, targets = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tgt_lens = torch.tensor([t.size(0) for t in targets])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    targets = nn.utils.rnn.pad_sequence(targets, batch_first=True)
    return feats, feat_lens, targets, tgt_lens


class CTCModel(nn.Module):
    def __init__(self, n_mels, hidden, layers, vocab):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.GELU(),
        )
        self.proj = nn.Linear(32 * ((n_mels + 3) // 4), hidden)
        self.norm = nn.LayerNorm(hidden)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True,
                           bidirectional=True, dropout=0.1)
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(self, x, lens):
        x = self.subsample(x.unsqueeze(1))            # B x C x T/4 x F/4
        b, c, t, f = x.shape
        x = self.norm(self.proj(x.transpose(1, 2).reshape(b, t, c * f)))
        lens = ((lens + 1) // 2 + 1) // 2
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        return self.out(x).log_softmax(-1), lens


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return d[len(b)]


def greedy_decode(logp, lens):
    hyps = []
    for seq, n in zip(logp.argmax(-1), lens):
        out, last = [], 0
        for tok in seq[:n].tolist():
            if tok != last and tok != 0:
                out.append(VOCAB[tok])
            last = tok
        hyps.append("".join(out))
    return hyps


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        train_ds = ManifestDataset(cfg["train_manifest"], cfg["n_mels"], cfg["max_duration"])
        dev_ds = ManifestDataset(cfg["dev_manifest"], cfg["n_mels"], 35.0)
        dev_ds = Subset(dev_ds, list(range(self.rank, len(dev_ds), self.world_size)))
        self.train_sampler = DistributedSampler(train_ds, num_replicas=self.world_size,
                                                rank=self.rank, shuffle=True)
        self.train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=self.train_sampler,
                                       collate_fn=collate, num_workers=cfg["num_workers"],
                                       pin_memory=True, drop_last=True)
        self.dev_loader = DataLoader(dev_ds, batch_size=cfg["batch_size"], collate_fn=collate,
                                     num_workers=cfg["num_workers"])

        model = CTCModel(cfg["n_mels"], cfg["hidden"], cfg["layers"], len(VOCAB)).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=1e-2)
        warm = cfg["warmup_steps"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min((s + 1) / warm, (warm / (s + 1)) ** 0.5))
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.step = 0
        self.start_epoch = 0
        self.ckpt_path = os.path.join(cfg["exp_dir"], "last.pt")
        if os.path.exists(self.ckpt_path):
            self.load_checkpoint()

    def log(self, msg):
        if self.rank == 0:
            print(time.strftime("%H:%M:%S"), msg, flush=True)

    def save_checkpoint(self, epoch):
        if self.rank != 0:
            return
        os.makedirs(self.cfg["exp_dir"], exist_ok=True)
        torch.save({"model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "epoch": epoch, "step": self.step}, self.ckpt_path)

    def load_checkpoint(self):
        ckpt = torch.load(self.ckpt_path, map_location=self.device)
        self.model.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.start_epoch, self.step = ckpt["epoch"] + 1, ckpt["step"]
        self.log(f"resumed from epoch {ckpt['epoch']}")

    def train_epoch(self, epoch):
        self.model.train()
        tot = torch.zeros(2, device=self.device)
        for feats, feat_lens, targets, tgt_lens in self.train_loader:
            feats, targets = feats.to(self.device), targets.to(self.device)
            logp, out_lens = self.model(feats, feat_lens)
            loss = self.ctc(logp.transpose(0, 1), targets, out_lens, tgt_lens)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            tot += torch.stack([loss.detach(), torch.ones((), device=self.device)])
            if self.step % self.cfg["log_every"] == 0:
                self.log(f"epoch {epoch} step {self.step} ctc {loss.item():.3f} "
                         f"lr {self.scheduler.get_last_lr()[0]:.2e}")
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        errs = torch.zeros(2, device=self.device)  # char errors, ref chars
        for feats, feat_lens, targets, tgt_lens in self.dev_loader:
            logp, out_lens = self.model.module(feats.to(self.device), feat_lens)
            hyps = greedy_decode(logp, out_lens)
            for hyp, tgt, n in zip(hyps, targets, tgt_lens):
                ref = "".join(VOCAB[i] for i in tgt[:n].tolist())
                errs[0] += edit_distance(hyp, ref)
                errs[1] += len(ref)
        dist.all_reduce(errs)
        return (errs[0] / errs[1]).item()

    def fit(self):
        self.log(f"{len(self.train_loader)} batches/epoch on each of {self.world_size} GPUs")
        for epoch in range(self.start_epoch, self.cfg["epochs"]):
            t0 = time.time()
            train_loss = self.train_epoch(epoch)
            cer = self.validate()
            self.log(f"epoch {epoch} train_ctc {train_loss:.3f} dev_cer {cer * 100:.2f} "
                     f"({time.time() - t0:.0f}s)")
            self.save_checkpoint(epoch)
            dist.barrier()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()

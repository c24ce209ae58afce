"""Sentence-level lip reading with a character CTC model (LRS2 main + pretrain).

Frontend: 3D conv + ResNet-18 (initialised from an LRW word model), backend: 3-layer BiGRU.
Output units are characters, so the vocabulary is taken from the training transcripts.

    torchrun --nproc_per_node=4 08_lipreading_sentence_ctc.py \
        --lrs2 /datasets/LRS2 --lrw-init pretrained/lrw_resnet18.pth
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def load_split(root, split, subdir):
    samples = []
    with open(os.path.join(root, split + ".txt")) as f:
        for line in f:
            uid = line.split()[0]
            with open(os.path.join(root, subdir, uid + ".txt")) as g:
                text = g.readline().split(":", 1)[1].strip().upper()
            samples.append((os.path.join(root, "roi", subdir, uid + ".npy"), text))
    return samples


def build_vocab(texts):
    chars = set()
    for t in texts:
        chars.update(t)
    itos = ["<blank>"] + list(chars)
    return itos, {c: i for i, c in enumerate(itos)}


class LipSentences(Dataset):
    def __init__(self, samples, stoi, train, max_frames=None):
        self.samples = [s for s in samples if max_frames is None or np.load(s[0], mmap_mode="r").shape[0] <= max_frames]
        self.stoi, self.train = stoi, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, text = self.samples[i]
        v = np.load(path).astype(np.float32) / 255.0
        if self.train:
            y, x = np.random.randint(0, 9, 2)
            v = v[:, y:y + 88, x:x + 88]
            if np.random.rand() < 0.5:
                v = v[:, :, ::-1]
        else:
            v = v[:, 4:92, 4:92]
        v = (np.ascontiguousarray(v) - 0.421) / 0.165
        y = torch.tensor([self.stoi[c] for c in text if c in self.stoi], dtype=torch.long)
        return torch.from_numpy(v), y, text


def collate(batch):
    v, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(v, batch_first=True), torch.tensor([len(x) for x in v]),
            torch.cat(y), torch.tensor([len(x) for x in y]), list(t))


def basic_block(cin, cout, stride):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LipNetCTC(nn.Module):
    def __init__(self, n_tokens, hidden=512):
        super().__init__()
        self.frontend = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.ReLU(inplace=True),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.resnet = nn.Sequential(basic_block(64, 64, 1), basic_block(64, 128, 2),
                                    basic_block(128, 256, 2), basic_block(256, 512, 2))
        self.gru = nn.GRU(512, hidden, num_layers=3, batch_first=True, bidirectional=True, dropout=0.3)
        self.classifier = nn.Linear(2 * hidden, n_tokens)

    def forward(self, v, lens):
        b, t = v.shape[:2]
        x = self.frontend(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        x = F.adaptive_avg_pool2d(self.resnet(x), 1).view(b, t, 512)
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.gru(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True, total_length=t)
        return self.classifier(x).log_softmax(-1)


def edit_distance(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@torch.no_grad()
def evaluate(model, loader, itos, device):
    model.eval()
    c = torch.zeros(4, device=device, dtype=torch.float64)  # char err, chars, word err, words
    for v, lens, _, _, texts in loader:
        logp = model(v.to(device), lens.to(device))
        for seq, n, ref in zip(logp.argmax(-1).cpu(), lens.tolist(), texts):
            hyp = "".join(itos[k] for k in torch.unique_consecutive(seq[:n]).tolist() if k != 0)
            c[0] += edit_distance(hyp, ref)
            c[1] += len(ref)
            c[2] += edit_distance(hyp.split(), ref.split())
            c[3] += len(ref.split())
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item(), (c[2] / c[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lrs2", required=True)
    ap.add_argument("--lrw-init", default=None)
    ap.add_argument("--out", default="runs/lrs2_char_ctc")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-frames", type=int, default=300)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    train_samples = load_split(args.lrs2, "pretrain", "pretrain") + load_split(args.lrs2, "train", "main")
    val_samples = load_split(args.lrs2, "val", "main")
    itos, stoi = build_vocab([t for _, t in train_samples])

    train_ds = LipSentences(train_samples, stoi, train=True, max_frames=args.max_frames)
    val_ds = LipSentences(val_samples, stoi, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs, num_workers=4, collate_fn=collate)

    model = LipNetCTC(len(itos))
    if args.lrw_init:
        sd = torch.load(args.lrw_init, map_location="cpu")
        sd = {k: v for k, v in sd.items() if k.startswith(("frontend.", "resnet."))}
        model.load_state_dict(sd, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab.json"), "w") as f:
            json.dump(itos, f, ensure_ascii=False)
        print(f"{len(train_ds)} train clips, {len(val_ds)} val clips, {len(itos)} output units")

    best_wer = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot, n = time.time(), 0.0, 0
        for i, (v, lens, y, ylens, _) in enumerate(train_dl):
            v, lens = v.to(device, non_blocking=True), lens.to(device)
            logp = model(v, lens)
            loss = ctc(logp.transpose(0, 1), y.to(device), lens, ylens.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            tot, n = tot + loss.item(), n + 1
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} [{i}/{len(train_dl)}] ctc {tot / n:.3f} ({time.time() - t0:.0f}s)", flush=True)

        cer, wer = evaluate(model.module, val_dl, itos, device)
        sched.step(wer)
        if rank == 0:
            print(f"epoch {epoch}: CER {cer:.4f} WER {wer:.4f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "vocab": itos, "cer": cer, "wer": wer}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if wer < best_wer:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        best_wer = min(best_wer, wer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

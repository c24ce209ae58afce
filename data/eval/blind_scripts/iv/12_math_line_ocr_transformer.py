"""Printed math-line OCR: small ResNet encoder + Transformer decoder.

Usage:
    torchrun --nproc_per_node=4 12_math_line_ocr_transformer.py --data_dir data/mathlines
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nltk.translate.bleu_score import corpus_bleu, SmoothingFunction
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    parser = argparse.ArgumentParser("math line OCR")
    parser.add_argument("--data_dir", type=str, default="data/mathlines")
    parser.add_argument("--output_dir", type=str, default="output/mathline_tf")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--img_h", type=int, default=64)
    parser.add_argument("--max_w", type=int, default=1600)
    parser.add_argument("--max_len", type=int, default=192)
    parser.add_argument("--d_model", type=int, default=384)
    return parser.parse_args()


class LineDataset(Dataset):
    def __init__(self, data_dir, split, vocab, img_h, max_w, max_len):
        self.samples = []
        with open(os.path.join(data_dir, split + ".txt"), encoding="utf-8") as f:
            for line in f:
                name, text = line.rstrip("\n").split(" ", 1)
                self.samples.append((os.path.join(data_dir, "lines", name), text.split()))
        self.vocab, self.img_h, self.max_w, self.max_len = vocab, img_h, max_w, max_len
        self.norm = transforms.Normalize([0.5], [0.5])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, toks = self.samples[idx]
        im = Image.open(path).convert("L")
        w = min(self.max_w, max(32, int(im.width * self.img_h / im.height)))
        im = im.resize((w, self.img_h), Image.BILINEAR)
        x = self.norm(transforms.functional.to_tensor(im))
        y = [1] + [self.vocab.get(t, 3) for t in toks][: self.max_len - 2] + [2]
        return x, torch.tensor(y)


def collate_fn(batch):
    imgs, tgts = zip(*batch)
    w = max(i.shape[2] for i in imgs)
    x = torch.ones(len(imgs), 1, imgs[0].shape[1], w)
    for k, i in enumerate(imgs):
        x[k, :, :, : i.shape[2]] = i
    return x, nn.utils.rnn.pad_sequence(tgts, batch_first=True, padding_value=0)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = nn.Sequential()
        if stride != 1 or cin != cout:
            self.sc = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.sc(x))


class MathLineOCR(nn.Module):
    def __init__(self, vocab_size, d_model, max_len):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
            BasicBlock(64, 64, 2), BasicBlock(64, 128, 2), BasicBlock(128, 256, 2), BasicBlock(256, d_model, 2))
        self.src_pos = nn.Embedding(4 * 128, d_model)
        self.tgt_emb = nn.Embedding(vocab_size, d_model)
        self.tgt_pos = nn.Embedding(max_len, d_model)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d_model, 6, 4 * d_model, batch_first=True), 4)
        self.generator = nn.Linear(d_model, vocab_size)

    def encode(self, x):
        f = self.cnn(x).flatten(2).transpose(1, 2)
        return f + self.src_pos(torch.arange(f.shape[1], device=x.device))

    def decode(self, mem, y):
        L = y.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=y.device), diagonal=1)
        h = self.tgt_emb(y) + self.tgt_pos(torch.arange(L, device=y.device))
        return self.generator(self.decoder(h, mem, tgt_mask=mask))

    def forward(self, x, y):
        return self.decode(self.encode(x), y)

    @torch.no_grad()
    def greedy_decode(self, x, max_len):
        mem = self.encode(x)
        y = torch.full((x.shape[0], max_len), 0, dtype=torch.long, device=x.device)
        y[:, 0] = 1
        for t in range(1, max_len):
            y[:, t] = self.decode(mem, y[:, :t])[:, -1].argmax(-1)
            if ((y == 2).any(1)).all():
                break
        return y


def to_tokens(ids, itos):
    out = []
    for i in ids[1:]:
        if i == 2:
            break
        if i > 3:
            out.append(itos[i])
    return out


@torch.no_grad()
def evaluate(model, loader, itos, max_len, device):
    model.eval()
    world_size = dist.get_world_size()
    hyps, refs = [], []
    for x, y in loader:
        pred = model.module.greedy_decode(x.to(device), max_len)
        ref = F.pad(y, (0, max_len - y.shape[1])).to(device)
        # fixed [B, max_len] shapes so the gather is shape-compatible on every rank
        gp = [torch.zeros_like(pred) for _ in range(world_size)]
        gr = [torch.zeros_like(ref) for _ in range(world_size)]
        dist.all_gather(gp, pred)
        dist.all_gather(gr, ref)
        for p, r in zip(torch.cat(gp).tolist(), torch.cat(gr).tolist()):
            hyps.append(to_tokens(p, itos))
            refs.append([to_tokens(r, itos)])
    model.train()
    bleu = corpus_bleu(refs, hyps, smoothing_function=SmoothingFunction().method1)
    acc = sum(h == r[0] for h, r in zip(hyps, refs)) / len(hyps)
    return bleu, acc


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", args.local_rank)
    rank = dist.get_rank()
    is_master = rank == 0

    with open(os.path.join(args.data_dir, "vocab.txt"), encoding="utf-8") as f:
        itos = ["<pad>", "<s>", "</s>", "<unk>"] + [l.strip() for l in f if l.strip()]
    vocab = {t: i for i, t in enumerate(itos)}

    train_set = LineDataset(args.data_dir, "train", vocab, args.img_h, args.max_w, args.max_len)
    val_set = LineDataset(args.data_dir, "val", vocab, args.img_h, args.max_w, args.max_len)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              collate_fn=collate_fn, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler, num_workers=4,
                            collate_fn=collate_fn)

    model = MathLineOCR(len(itos), args.d_model, args.max_len)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.1)

    if is_master:
        os.makedirs(args.output_dir, exist_ok=True)
    best_bleu = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            out = model(x, y[:, :-1])
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1), ignore_index=0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if is_master and i % 100 == 0:
                print(f"Epoch[{epoch}] Iter[{i}/{len(train_loader)}] loss: {loss.item():.4f}", flush=True)
        scheduler.step()

        bleu, acc = evaluate(model, val_loader, itos, args.max_len, device)
        if is_master:
            print(f"Epoch[{epoch}] time {time.time() - start:.0f}s  BLEU-4 {bleu:.4f}  line acc {acc:.4f}",
                  flush=True)
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best.pth"))
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

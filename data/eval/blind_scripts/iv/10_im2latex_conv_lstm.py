"""CRNN-style encoder (height collapsed to 1) + attention GRU decoder, optional joint CTC loss.

    torchrun --nproc_per_node=4 10_im2latex_conv_lstm.py --data data/im2latex --epochs 20
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BLANK = PAD = 0
SOS, EOS = 1, 2


def get_parser():
    p = argparse.ArgumentParser(description="im2latex CRNN-attention")
    p.add_argument("--data", default="data/im2latex")
    p.add_argument("--save_dir", default="checkpoints/crnn_attn")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ctc_weight", type=float, default=0.0, help="weight of the auxiliary CTC loss")
    p.add_argument("--teacher_forcing", type=float, default=1.0)
    p.add_argument("--max_len", type=int, default=150)
    p.add_argument("--seed", type=int, default=7)
    return p


class Im2Latex(Dataset):
    def __init__(self, root, split, stoi, height, max_len):
        with open(os.path.join(root, f"{split}.json")) as f:
            data = json.load(f)
        self.items = [(d["file"], d["tokens"]) for d in data if len(d["tokens"]) <= max_len - 2]
        self.root, self.stoi, self.height = root, stoi, height

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        fname, tokens = self.items[idx]
        img = Image.open(os.path.join(self.root, "images", fname)).convert("L")
        w = max(self.height, int(img.width * self.height / img.height))
        img = np.asarray(img.resize((w, self.height), Image.BILINEAR), dtype=np.float32) / 255.0
        ids = [self.stoi.get(t, 3) for t in tokens]
        return torch.from_numpy(1.0 - img)[None], torch.tensor(ids, dtype=torch.long)


def collate(batch):
    batch.sort(key=lambda b: b[0].shape[-1], reverse=True)
    imgs, labels = zip(*batch)
    W = imgs[0].shape[-1]
    x = torch.zeros(len(imgs), 1, imgs[0].shape[1], W)
    for i, im in enumerate(imgs):
        x[i, ..., : im.shape[-1]] = im
    label_lens = torch.tensor([len(l) for l in labels])
    flat = torch.cat(labels)
    dec_in = nn.utils.rnn.pad_sequence([torch.cat([torch.tensor([SOS]), l]) for l in labels], batch_first=True)
    dec_out = nn.utils.rnn.pad_sequence([torch.cat([l, torch.tensor([EOS])]) for l in labels], batch_first=True)
    widths = torch.tensor([im.shape[-1] for im in imgs])
    return x, widths, flat, label_lens, dec_in, dec_out


class CRNNEncoder(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        cfg = [(1, 64), (64, 128), (128, 256), (256, 256), (256, 512), (512, 512)]
        pools = [(2, 2), (2, 2), None, (2, 1), None, (2, 1)]
        layers = []
        for (ci, co), pool in zip(cfg, pools):
            layers += [nn.Conv2d(ci, co, 3, 1, 1), nn.InstanceNorm2d(co, affine=True), nn.ReLU(True)]
            if pool:
                layers.append(nn.MaxPool2d(pool, pool))
        self.cnn = nn.Sequential(*layers)
        self.rnn = nn.LSTM(512, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=0.1)

    def forward(self, x):
        f = self.cnn(x)                       # B, 512, H/16, W/4
        f = f.mean(2).transpose(1, 2)         # B, T, 512
        out, _ = self.rnn(f)
        return out                            # B, T, 2*hidden


class Model(nn.Module):
    def __init__(self, vocab_size, hidden):
        super().__init__()
        self.encoder = CRNNEncoder(hidden)
        self.ctc_head = nn.Linear(2 * hidden, vocab_size)
        self.embed = nn.Embedding(vocab_size, hidden)
        self.gru = nn.GRU(hidden + 2 * hidden, hidden, batch_first=True)
        self.attn_k = nn.Linear(2 * hidden, hidden)
        self.attn_q = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden + 2 * hidden, vocab_size)

    def attend(self, h, keys, values, mask):
        score = torch.bmm(self.attn_q(h), keys.transpose(1, 2))        # B, 1, T
        score = score.masked_fill(~mask[:, None], float("-inf"))
        return torch.bmm(score.softmax(-1), values)                     # B, 1, 2H

    def forward(self, x, widths, dec_in, use_ctc):
        enc = self.encoder(x)
        T = enc.shape[1]
        enc_lens = torch.clamp(widths // 4, max=T)
        mask = torch.arange(T, device=x.device)[None] < enc_lens[:, None].to(x.device)
        keys = self.attn_k(enc)
        h = None
        ctx = enc.new_zeros(enc.shape[0], 1, enc.shape[2])
        logits = []
        for t in range(dec_in.shape[1]):
            e = self.embed(dec_in[:, t:t + 1])
            o, h = self.gru(torch.cat([e, ctx], -1), h)
            ctx = self.attend(o, keys, enc, mask)
            logits.append(self.classifier(torch.cat([o, ctx], -1)))
        ctc_logp = self.ctc_head(enc).log_softmax(-1) if use_ctc else None
        return torch.cat(logits, 1), ctc_logp, enc_lens


def main():
    args = get_parser().parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "vocab.json")) as f:
        itos = json.load(f)                   # ["<blank/pad>", "<sos>", "<eos>", "<unk>", ...]
    stoi = {s: i for i, s in enumerate(itos)}
    train_ds = Im2Latex(args.data, "train", stoi, args.height, args.max_len)
    val_ds = Im2Latex(args.data, "val", stoi, args.height, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate)

    model = Model(len(itos), args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 15], gamma=0.3)
    ctc = nn.CTCLoss(blank=BLANK, zero_infinity=True)
    use_ctc = args.ctc_weight > 0

    os.makedirs(args.save_dir, exist_ok=True)
    best_loss = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, widths, flat, label_lens, dec_in, dec_out) in enumerate(loader):
            x, dec_in, dec_out = x.to(device), dec_in.to(device), dec_out.to(device)
            logits, ctc_logp, enc_lens = model(x, widths, dec_in, use_ctc)
            loss = F.cross_entropy(logits.transpose(1, 2), dec_out, ignore_index=PAD)
            if use_ctc:
                l_ctc = ctc(ctc_logp.transpose(0, 1), flat.to(device), enc_lens, label_lens)
                loss = (1 - args.ctc_weight) * loss + args.ctc_weight * l_ctc
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it} loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, widths, flat, label_lens, dec_in, dec_out in val_loader:
                logits, _, _ = model.module(x.to(device), widths, dec_in.to(device), False)
                dec_out = dec_out.to(device)
                tot[0] += F.cross_entropy(logits.transpose(1, 2), dec_out, ignore_index=PAD, reduction="sum")
                tot[1] += dec_out.ne(PAD).sum()
        dist.all_reduce(tot)
        val_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val token NLL {val_loss:.4f}", flush=True)
            if val_loss < best_loss:
                best_loss = val_loss
                torch.save({"state_dict": model.module.state_dict(), "itos": itos, "args": vars(args)},
                           os.path.join(args.save_dir, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

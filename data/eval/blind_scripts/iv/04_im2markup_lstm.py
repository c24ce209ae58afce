#!/usr/bin/env python3
# Multi-GPU port of the im2markup (Deng et al. 2017) coarse attention model.
#
#   torchrun --nproc_per_node=4 04_im2markup_lstm.py --data_path data/im2latex-100k --beam 5
import argparse
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
import numpy as np
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, GO, END, UNK = 0, 1, 2, 3


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_path", default="data/im2latex-100k")
    p.add_argument("--model_dir", default="model_im2markup")
    p.add_argument("--num_epochs", type=int, default=12)
    p.add_argument("--batch_size", type=int, default=20)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--lr_decay", type=float, default=0.5)
    p.add_argument("--encoder_num_hidden", type=int, default=256)
    p.add_argument("--decoder_num_hidden", type=int, default=512)
    p.add_argument("--target_embedding_size", type=int, default=80)
    p.add_argument("--max_num_tokens", type=int, default=150)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--val_every", type=int, default=1)
    return p.parse_args()


def load_vocab(path):
    itos = ["<pad>", "<go>", "<end>", "<unk>"]
    with open(path) as f:
        itos += [l.rstrip("\n") for l in f if l.rstrip("\n")]
    return itos, {t: i for i, t in enumerate(itos)}


class Im2LatexSplit(Dataset):
    def __init__(self, root, split, stoi, max_tokens):
        with open(os.path.join(root, "formulas.norm.lst"), encoding="latin-1") as f:
            formulas = f.read().split("\n")
        self.items = []
        with open(os.path.join(root, f"{split}_filter.lst")) as f:
            for line in f:
                name, idx = line.strip().split()
                toks = formulas[int(idx)].split()
                if len(toks) <= max_tokens:
                    self.items.append((name, toks))
        self.root, self.stoi = root, stoi

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, toks = self.items[i]
        im = np.asarray(Image.open(os.path.join(self.root, "images_processed", name)).convert("L"), np.float32)
        x = torch.from_numpy(1.0 - im / 255.0)[None]          # ink = 1
        y = [GO] + [self.stoi.get(t, UNK) for t in toks] + [END]
        return x, torch.tensor(y)


def collate(batch):
    # im2markup buckets images by size, so within a batch shapes are close; pad the rest
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    out = torch.zeros(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        out[i, :, : x.shape[1], : x.shape[2]] = x
    return out, nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=PAD)


class Encoder(nn.Module):
    def __init__(self, hidden):
        super().__init__()

        def blk(i, o, pool=None):
            layers = [nn.Conv2d(i, o, 3, 1, 1), nn.GroupNorm(16, o), nn.ReLU(True)]
            if pool:
                layers.append(nn.MaxPool2d(pool, pool))
            return layers

        self.cnn = nn.Sequential(*blk(1, 64, 2), *blk(64, 128, 2), *blk(128, 256), *blk(256, 256, (2, 1)),
                                 *blk(256, 512, (1, 2)), *blk(512, 512))
        self.rnn = nn.LSTM(512, hidden, batch_first=True, bidirectional=True)
        self.row_h0 = nn.Embedding(256, 2 * 2 * hidden)   # trainable initial state per row

    def forward(self, x):
        f = self.cnn(x)
        B, C, H, W = f.shape
        rows = f.permute(0, 2, 3, 1).reshape(B * H, W, C)
        h0 = self.row_h0(torch.arange(H, device=x.device)).view(H, 2, 2, -1)   # H, (h,c), dir, hid
        h0 = h0.unsqueeze(0).expand(B, -1, -1, -1, -1).reshape(B * H, 2, 2, -1)
        h, c = h0[:, 0].transpose(0, 1).contiguous(), h0[:, 1].transpose(0, 1).contiguous()
        out, _ = self.rnn(rows, (h, c))
        return out.reshape(B, H * W, -1)


class AttnDecoder(nn.Module):
    def __init__(self, vocab, emb, enc_dim, hid):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTMCell(emb + hid, hid)
        self.W_e = nn.Linear(enc_dim, hid, bias=False)
        self.W_h = nn.Linear(hid, hid)
        self.v = nn.Linear(hid, 1, bias=False)
        self.W_c = nn.Linear(enc_dim + hid, hid, bias=False)
        self.out = nn.Linear(hid, vocab)
        self.hid = hid

    def step(self, y, h, c, o, V, V_proj):
        h, c = self.lstm(torch.cat([self.emb(y), o], -1), (h, c))
        a = self.v(torch.tanh(V_proj + self.W_h(h)[:, None])).squeeze(-1).softmax(-1)
        ctx = torch.bmm(a[:, None], V).squeeze(1)
        o = torch.tanh(self.W_c(torch.cat([h, ctx], -1)))
        return F.log_softmax(self.out(o), -1), h, c, o


class Im2Markup(nn.Module):
    def __init__(self, vocab, a):
        super().__init__()
        self.encoder = Encoder(a.encoder_num_hidden)
        self.decoder = AttnDecoder(vocab, a.target_embedding_size, 2 * a.encoder_num_hidden,
                                   a.decoder_num_hidden)

    def forward(self, img, y_in):
        V = self.encoder(img)
        Vp = self.decoder.W_e(V)
        B = img.shape[0]
        h = c = o = V.new_zeros(B, self.decoder.hid)
        outs = []
        for t in range(y_in.shape[1]):
            lp, h, c, o = self.decoder.step(y_in[:, t], h, c, o, V, Vp)
            outs.append(lp)
        return torch.stack(outs, 1)

    @torch.no_grad()
    def beam_search(self, img, beam, max_len):
        """img: 1 x 1 x H x W. Returns the best token list (without GO/END)."""
        V = self.encoder(img)
        Vp = self.decoder.W_e(V)
        hyps = [([GO], 0.0, None)]
        z = V.new_zeros(1, self.decoder.hid)
        states = [(z, z, z)]
        finished = []
        for _ in range(max_len):
            k = len(hyps)
            y = torch.tensor([hh[0][-1] for hh in hyps], device=img.device)
            h = torch.cat([s[0] for s in states]); c = torch.cat([s[1] for s in states])
            o = torch.cat([s[2] for s in states])
            lp, h, c, o = self.decoder.step(y, h, c, o, V.expand(k, -1, -1), Vp.expand(k, -1, -1))
            scores = torch.tensor([hh[1] for hh in hyps], device=img.device)[:, None] + lp
            top, idx = scores.view(-1).topk(beam)
            new_hyps, new_states = [], []
            for s, ix in zip(top.tolist(), idx.tolist()):
                src, tok = divmod(ix, lp.shape[1])
                seq = hyps[src][0] + [tok]
                if tok == END:
                    finished.append((seq, s / len(seq)))
                else:
                    new_hyps.append((seq, s, None))
                    new_states.append((h[src:src + 1], c[src:src + 1], o[src:src + 1]))
            if len(finished) >= beam or not new_hyps:
                break
            hyps, states = new_hyps, new_states
        if not finished:
            finished = [(hh[0], hh[1] / len(hh[0])) for hh in hyps]
        best = max(finished, key=lambda t: t[1])[0]
        return [t for t in best[1:] if t != END]


def decode_split(model, dataset, itos, beam, max_len, device):
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    hyps, refs = [], []
    for i in range(rank, len(dataset), world):
        img, y = dataset[i]
        pred = model.beam_search(img[None].to(device), beam, max_len)
        hyps.append((i, " ".join(itos[t] for t in pred)))
        refs.append((i, " ".join(itos[t] for t in y.tolist()[1:-1])))
    everything = [None] * world
    dist.all_gather_object(everything, (hyps, refs))
    model.train()
    if rank != 0:
        return None
    H = dict(h for part in everything for h in part[0])
    R = dict(r for part in everything for r in part[1])
    keys = sorted(H)
    bleu = sacrebleu.corpus_bleu([H[k] for k in keys], [[R[k] for k in keys]], tokenize="none").score
    em = sum(H[k] == R[k] for k in keys) / len(keys)
    return bleu, em


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    itos, stoi = load_vocab(os.path.join(args.data_path, "latex_vocab.txt"))
    train_set = Im2LatexSplit(args.data_path, "train", stoi, args.max_num_tokens)
    val_set = Im2LatexSplit(args.data_path, "validate", stoi, args.max_num_tokens)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        collate_fn=collate, pin_memory=True, drop_last=True)

    model = DDP(Im2Markup(len(itos), args).to(device), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9)
    best_bleu = 0.0
    os.makedirs(args.model_dir, exist_ok=True)

    for epoch in range(1, args.num_epochs + 1):
        sampler.set_epoch(epoch)
        tic, seen = time.time(), 0
        for step, (img, y) in enumerate(loader):
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lp = model(img, y[:, :-1])
            loss = F.nll_loss(lp.reshape(-1, lp.shape[-1]), y[:, 1:].reshape(-1), ignore_index=PAD)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            opt.step()
            seen += img.shape[0]
            if rank == 0 and step % 100 == 0:
                ppl = torch.exp(loss.detach()).item()
                print(f"epoch {epoch} step {step} ppl {ppl:.3f} {seen / (time.time() - tic):.1f} img/s/gpu",
                      flush=True)

        if epoch % args.val_every == 0:
            res = decode_split(model, val_set, itos, args.beam, args.max_num_tokens + 2, device)
            if rank == 0:
                bleu, em = res
                print(f"epoch {epoch} val BLEU {bleu:.2f} exact {em:.4f}", flush=True)
                if bleu > best_bleu:
                    best_bleu = bleu
                    torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch},
                               os.path.join(args.model_dir, "best.pt"))
                else:
                    for g in opt.param_groups:
                        g["lr"] *= args.lr_decay
            lr = torch.tensor([opt.param_groups[0]["lr"]], device=device)
            dist.broadcast(lr, src=0)
            for g in opt.param_groups:
                g["lr"] = lr.item()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# Listen-Attend-Spell style attention ASR, character targets.
# torchrun --nproc_per_node=4 06_las_attention_wer.py --data data/wsj --exp exp/las_wsj
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SOS_EOS, PAD_ID = 1, 0


class Vocab:
    def __init__(self, path):
        self.tokens = ["<pad>", "<sos/eos>"] + [l.split()[0] for l in open(path, encoding="utf-8")]
        self.idx = {t: i for i, t in enumerate(self.tokens)}

    def encode(self, text):
        return [self.idx.get(c, self.idx.get("<unk>", 2)) for c in text.replace(" ", "_")]

    def decode(self, ids):
        return "".join(self.tokens[i] for i in ids).replace("_", " ").strip()


class ASRDataset(Dataset):
    def __init__(self, data_dir, split, vocab):
        self.utts = []
        for line in open(os.path.join(data_dir, split, "data.list"), encoding="utf-8"):
            key, feat, text = line.rstrip("\n").split(" ", 2)
            self.utts.append((key, feat, text))
        self.vocab = vocab

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, i):
        key, feat, text = self.utts[i]
        return torch.from_numpy(np.load(feat)), torch.tensor(self.vocab.encode(text)), text


def collate_fn(batch):
    batch = sorted(batch, key=lambda b: -b[0].size(0))
    feats, ys, texts = zip(*batch)
    flens = torch.tensor([f.size(0) for f in feats])
    ys_in = [torch.cat([torch.tensor([SOS_EOS]), y]) for y in ys]
    ys_out = [torch.cat([y, torch.tensor([SOS_EOS])]) for y in ys]
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), flens,
            nn.utils.rnn.pad_sequence(ys_in, batch_first=True, padding_value=PAD_ID),
            nn.utils.rnn.pad_sequence(ys_out, batch_first=True, padding_value=-1), list(texts))


class PyramidalBLSTM(nn.Module):
    def __init__(self, idim, hdim, nlayers=3):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(nlayers):
            self.layers.append(nn.LSTM(idim if i == 0 else 4 * hdim, hdim, batch_first=True, bidirectional=True))

    def forward(self, x, lens):
        for i, rnn in enumerate(self.layers):
            packed = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True)
            x, _ = rnn(packed)
            x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
            if i < len(self.layers) - 1:
                T = x.size(1) // 2 * 2
                x = x[:, :T].reshape(x.size(0), T // 2, -1)
                lens = torch.clamp(lens // 2, min=1)
        return x, lens


class AttentionDecoder(nn.Module):
    def __init__(self, vocab_size, enc_dim, hdim, emb=256):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, emb, padding_idx=PAD_ID)
        self.cell = nn.LSTMCell(emb + enc_dim, hdim)
        self.q = nn.Linear(hdim, enc_dim)
        self.out = nn.Linear(hdim + enc_dim, vocab_size)
        self.hdim = hdim

    def step(self, y_prev, state, ctx, enc, mask):
        h, c = self.cell(torch.cat([self.embed(y_prev), ctx], -1), state)
        score = torch.bmm(enc, self.q(h).unsqueeze(2)).squeeze(2).masked_fill(mask, -1e4)
        att = score.softmax(-1)
        ctx = torch.bmm(att.unsqueeze(1), enc).squeeze(1)
        return self.out(torch.cat([h, ctx], -1)), (h, c), ctx

    def forward(self, enc, mask, ys_in, tf_ratio=1.0):
        B = enc.size(0)
        state = (enc.new_zeros(B, self.hdim), enc.new_zeros(B, self.hdim))
        ctx = enc.new_zeros(B, enc.size(2))
        outs, y = [], ys_in[:, 0]
        for t in range(ys_in.size(1)):
            logit, state, ctx = self.step(y, state, ctx, enc, mask)
            outs.append(logit)
            if t + 1 < ys_in.size(1):
                y = ys_in[:, t + 1] if random.random() < tf_ratio else logit.argmax(-1)
        return torch.stack(outs, 1)

    @torch.no_grad()
    def greedy(self, enc, mask, max_len):
        B = enc.size(0)
        state = (enc.new_zeros(B, self.hdim), enc.new_zeros(B, self.hdim))
        ctx = enc.new_zeros(B, enc.size(2))
        y = torch.full((B,), SOS_EOS, dtype=torch.long, device=enc.device)
        hyps = []
        for _ in range(max_len):
            logit, state, ctx = self.step(y, state, ctx, enc, mask)
            y = logit.argmax(-1)
            hyps.append(y)
        return torch.stack(hyps, 1)


class LAS(nn.Module):
    def __init__(self, idim, vocab_size, hdim=320):
        super().__init__()
        self.listener = PyramidalBLSTM(idim, hdim)
        self.speller = AttentionDecoder(vocab_size, 2 * hdim, 2 * hdim)

    def forward(self, feats, flens, ys_in, tf_ratio=1.0):
        enc, elens = self.listener(feats, flens)
        mask = torch.arange(enc.size(1), device=enc.device)[None] >= elens.to(enc.device)[:, None]
        return self.speller(enc, mask, ys_in, tf_ratio)

    def recognize(self, feats, flens, max_len=200):
        enc, elens = self.listener(feats, flens)
        mask = torch.arange(enc.size(1), device=enc.device)[None] >= elens.to(enc.device)[:, None]
        return self.speller.greedy(enc, mask, max_len)


def wer_counts(hyp, ref):
    h, r = hyp.split(), ref.split()
    d = np.zeros((len(r) + 1, len(h) + 1), dtype=np.int32)
    d[:, 0] = np.arange(len(r) + 1)
    d[0, :] = np.arange(len(h) + 1)
    for i in range(1, len(r) + 1):
        for j in range(1, len(h) + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (r[i - 1] != h[j - 1]))
    return int(d[len(r), len(h)]), len(r)


@torch.no_grad()
def evaluate(model, loader, vocab, device):
    model.eval()
    errs, words = 0, 0
    for feats, flens, _, _, texts in loader:
        out = model.recognize(feats.to(device), flens)
        for seq, ref in zip(out.tolist(), texts):
            if SOS_EOS in seq:
                seq = seq[: seq.index(SOS_EOS)]
            e, n = wer_counts(vocab.decode(seq), ref)
            errs += e
            words += n
    model.train()
    return 100.0 * errs / max(words, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)
    random.seed(7 + rank)

    vocab = Vocab(os.path.join(args.data, "units.txt"))
    train_set = ASRDataset(args.data, "train_si284", vocab)
    dev_set = ASRDataset(args.data, "test_dev93", vocab)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=collate_fn,
                              num_workers=4, drop_last=True)
    dev_loader = DataLoader(dev_set, 32, sampler=dev_sampler, collate_fn=collate_fn, num_workers=2)

    model = LAS(80, len(vocab.tokens)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.95, eps=1e-8) if args.lr <= 0 else \
        torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[15, 22], gamma=0.3)

    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    best_wer = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tf_ratio = max(0.7, 1.0 - 0.02 * epoch)
        t0 = time.time()
        tot, n = 0.0, 0
        for it, (feats, flens, ys_in, ys_out, _) in enumerate(train_loader):
            feats, ys_in, ys_out = feats.to(device), ys_in.to(device), ys_out.to(device)
            logits = model(feats, flens, ys_in, tf_ratio)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ys_out.reshape(-1),
                                   ignore_index=-1, label_smoothing=0.1)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            tot += loss.item()
            n += 1
            if rank == 0 and it % 100 == 0:
                print(f"[ep {epoch} it {it}] loss {loss.item():.4f} tf {tf_ratio:.2f}", flush=True)
        scheduler.step()

        dev_wer = evaluate(model.module, dev_loader, vocab, device)
        if rank == 0:
            writer.add_scalar("train/loss", tot / max(n, 1), epoch)
            writer.add_scalar("dev/wer", dev_wer, epoch)
            print(f"epoch {epoch} train_loss {tot / max(n, 1):.4f} dev WER {dev_wer:.2f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, f"epoch{epoch}.pt"))
            if dev_wer < best_wer:
                best_wer = dev_wer
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "wer": dev_wer},
                           os.path.join(args.exp, "model.best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best dev WER {best_wer:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

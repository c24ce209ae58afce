"""Handwritten math expression (HME) recognition: VGG-ish encoder + GRU decoder with coverage
attention, trained with DDP; ExpRate on CROHME 2014 test with beam search.

    torchrun --nproc_per_node=4 14_handwritten_formula_hme.py --config configs/hme_crohme.yaml
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SOS, EOS, PAD = 1, 2, 0


class HMEDataset(Dataset):
    def __init__(self, img_dir, label_file, word2id, scale=1.0):
        self.items = []
        with open(label_file, encoding="utf-8") as f:
            for line in f:
                parts = line.strip().split()
                if parts:
                    self.items.append((parts[0], parts[1:]))
        self.img_dir, self.w2i, self.scale = img_dir, word2id, scale

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, toks = self.items[i]
        im = Image.open(os.path.join(self.img_dir, name + ".png")).convert("L")
        if self.scale != 1.0:
            im = im.resize((int(im.width * self.scale), int(im.height * self.scale)), Image.BILINEAR)
        x = torch.from_numpy(255.0 - np.asarray(im, np.float32))[None] / 255.0
        y = torch.tensor([self.w2i[t] for t in toks] + [EOS])
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    img = torch.zeros(len(xs), 1, H, W)
    msk = torch.zeros(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        img[i, :, : x.shape[1], : x.shape[2]] = x
        msk[i, :, : x.shape[1], : x.shape[2]] = 1.0
    return img, msk, nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=PAD)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        chans = [(1, 32), (32, 64), (64, 64), (64, 128), (128, 128), (128, 256)]
        layers = []
        for i, (a, b) in enumerate(chans):
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(8, b), nn.ReLU(True)]
            if i in (0, 1, 3, 5):
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)    # stride 16, 256 channels


class CoverageDecoder(nn.Module):
    def __init__(self, vocab, ctx_dim=256, hid=256, emb=256, att=256):
        super().__init__()
        self.hid = hid
        self.embed = nn.Embedding(vocab, emb)
        self.init_fc = nn.Linear(ctx_dim, hid)
        self.gru = nn.GRUCell(emb + ctx_dim, hid)
        self.ctx_proj = nn.Conv2d(ctx_dim, att, 1)
        self.hid_proj = nn.Linear(hid, att)
        self.cov_conv = nn.Conv2d(1, 32, 11, padding=5)
        self.cov_proj = nn.Linear(32, att, bias=False)
        self.alpha_fc = nn.Linear(att, 1)
        self.out = nn.Linear(hid + ctx_dim + emb, vocab)

    def init_hidden(self, ctx, mask):
        mean = (ctx * mask).sum((2, 3)) / mask.sum((2, 3))
        h = torch.tanh(self.init_fc(mean))
        cov = torch.zeros(ctx.shape[0], 1, ctx.shape[2], ctx.shape[3], device=DEVICE)
        c_prev = torch.zeros(ctx.shape[0], ctx.shape[1], device=DEVICE)
        return h, cov, c_prev

    def step(self, y_prev, h, cov, c_prev, ctx, ctx_p, mask):
        e = self.embed(y_prev)
        h = self.gru(torch.cat([e, c_prev], -1), h)
        cov_f = self.cov_proj(self.cov_conv(cov).permute(0, 2, 3, 1))
        q = self.hid_proj(h)[:, None, None]
        energy = self.alpha_fc(torch.tanh(ctx_p + q + cov_f)).squeeze(-1)
        energy = energy.masked_fill(mask[:, 0] == 0, -1e4)
        alpha = energy.flatten(1).softmax(-1).view_as(energy)[:, None]
        c = (alpha * ctx).sum((2, 3))
        logit = self.out(torch.cat([h, c, e], -1))
        return logit, h, cov + alpha, c


class HMEModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = CoverageDecoder(vocab)

    def _prep(self, img, mask):
        ctx = self.encoder(img)
        m = F.max_pool2d(mask, 16, ceil_mode=True)[..., : ctx.shape[2], : ctx.shape[3]]
        return ctx, self.decoder.ctx_proj(ctx).permute(0, 2, 3, 1), m

    def forward(self, img, mask, tgt):
        ctx, ctx_p, m = self._prep(img, mask)
        h, cov, c = self.decoder.init_hidden(ctx, m)
        y_prev = torch.full((img.shape[0],), SOS, dtype=torch.long, device=img.device)
        outs = []
        for t in range(tgt.shape[1]):
            logit, h, cov, c = self.decoder.step(y_prev, h, cov, c, ctx, ctx_p, m)
            outs.append(logit)
            y_prev = tgt[:, t]
        return torch.stack(outs, 1)

    @torch.no_grad()
    def beam_search(self, img, mask, beam=10, max_len=200):
        ctx, ctx_p, m = self._prep(img, mask)            # batch of one
        h, cov, c = self.decoder.init_hidden(ctx, m)
        beams = [([SOS], 0.0, h, cov, c)]
        complete = []
        for _ in range(max_len):
            cands = []
            for seq, score, h, cov, c in beams:
                y = torch.tensor([seq[-1]], device=img.device)
                logit, h2, cov2, c2 = self.decoder.step(y, h, cov, c, ctx, ctx_p, m)
                lp = logit.log_softmax(-1)[0]
                top_lp, top_id = lp.topk(beam)
                for l, k in zip(top_lp.tolist(), top_id.tolist()):
                    cands.append((seq + [k], score + l, h2, cov2, c2))
            cands.sort(key=lambda b: b[1], reverse=True)
            beams = []
            for b in cands[:beam]:
                (complete if b[0][-1] == EOS else beams).append(b)
            if not beams or len(complete) >= beam:
                break
        pool = complete or beams
        best = max(pool, key=lambda b: b[1] / len(b[0]))
        return [t for t in best[0][1:] if t != EOS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/hme_crohme.yaml")
    cfg = yaml.safe_load(open(ap.parse_args().config))

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    words = [l.split()[0] for l in open(cfg["dictionary"], encoding="utf-8") if l.strip()]
    w2i = {w: i for i, w in enumerate(words)}          # 0 <pad>, 1 <sos>, 2 <eos>
    train_ds = HMEDataset(cfg["train_images"], cfg["train_labels"], w2i)
    test_ds = HMEDataset(cfg["test_images"], cfg["test_labels"], w2i)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(HMEModel(len(words)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adadelta(model.parameters(), lr=cfg.get("lr", 1.0), weight_decay=1e-4)
    os.makedirs(cfg["save_dir"], exist_ok=True)
    best = 0.0

    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        total = 0.0
        for img, msk, tgt in train_dl:
            img, msk, tgt = img.to(device), msk.to(device), tgt.to(device)
            logits = model(img, msk, tgt)
            loss = F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=PAD)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / len(train_dl):.4f}", flush=True)

        if (epoch + 1) % cfg.get("eval_every", 5) == 0:
            model.eval()
            right = torch.zeros(2, device=device)
            for i in range(rank, len(test_ds), world):
                x, y = test_ds[i]
                x = x[None].to(device)
                pred = model.module.beam_search(x, torch.ones_like(x), beam=cfg.get("beam", 10))
                right[0] += float(pred == y[:-1].tolist())
                right[1] += 1
            dist.all_reduce(right)
            exprate = (right[0] / right[1]).item()
            if rank == 0:
                print(f"epoch {epoch}: ExpRate {exprate:.4f}", flush=True)
                if exprate > best:
                    best = exprate
                    torch.save({"model": model.module.state_dict(), "words": words},
                               os.path.join(cfg["save_dir"], "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

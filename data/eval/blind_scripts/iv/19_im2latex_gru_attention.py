"""Train an im2latex GRU-attention model with DDP, then decode the test set with the best
checkpoint (beam search) and write predictions + BLEU / exact match.

    torchrun --nproc_per_node=4 19_im2latex_gru_attention.py --data data/im2latex-100k
"""
import argparse
import json
import os

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/im2latex-100k")
    p.add_argument("--exp", default="exp/gru_attn")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max_len", type=int, default=150)
    return p.parse_args()


class Split(Dataset):
    def __init__(self, root, name, stoi, max_len):
        self.rows = [json.loads(l) for l in open(os.path.join(root, f"{name}.jsonl"))]
        self.rows = [r for r in self.rows if len(r["tokens"]) <= max_len - 2]
        self.root, self.stoi = root, stoi
        self.tf = T.Compose([T.Grayscale(), T.ToTensor(), T.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        x = self.tf(Image.open(os.path.join(self.root, "images", r["image"])))
        return x, torch.tensor([1] + [self.stoi.get(t, 3) for t in r["tokens"]] + [2])


def collate(batch):
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    img = torch.ones(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        img[i, :, : x.shape[1], : x.shape[2]] = x
    return img, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class GRUAttn(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        def block(i, o):
            return [nn.Conv2d(i, o, 3, 1, 1), nn.GroupNorm(16, o), nn.ReLU(True)]
        self.cnn = nn.Sequential(*block(1, 64), nn.MaxPool2d(2), *block(64, 128), nn.MaxPool2d(2),
                                 *block(128, 256), *block(256, 256), nn.MaxPool2d((2, 1)),
                                 *block(256, 512), nn.MaxPool2d((1, 2)), *block(512, 512))
        self.pos_h = nn.Embedding(64, 512)
        self.pos_w = nn.Embedding(512, 512)
        self.embed = nn.Embedding(vocab, 256)
        self.gru = nn.GRUCell(256 + 512, hidden)
        self.q = nn.Linear(hidden, 512)
        self.init = nn.Linear(512, hidden)
        self.out = nn.Sequential(nn.Linear(hidden + 512, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def encode(self, x):
        f = self.cnn(x).permute(0, 2, 3, 1)
        B, H, W, C = f.shape
        f = f + self.pos_h.weight[:H, None] + self.pos_w.weight[None, :W]
        return f.reshape(B, H * W, C)

    def step(self, y, h, ctx, mem):
        h = self.gru(torch.cat([self.embed(y), ctx], -1), h)
        a = torch.einsum("bnc,bc->bn", mem, self.q(h)).div(mem.shape[-1] ** 0.5).softmax(-1)
        ctx = torch.einsum("bn,bnc->bc", a, mem)
        return self.out(torch.cat([h, ctx], -1)), h, ctx

    def forward(self, x, y_in):
        mem = self.encode(x)
        h = torch.tanh(self.init(mem.mean(1)))
        ctx = mem.mean(1)
        outs = []
        for t in range(y_in.shape[1]):
            o, h, ctx = self.step(y_in[:, t], h, ctx, mem)
            outs.append(o)
        return torch.stack(outs, 1)

    @torch.no_grad()
    def beam_search(self, x, k, max_len):
        mem = self.encode(x)                     # 1, N, C
        h = torch.tanh(self.init(mem.mean(1)))
        ctx = mem.mean(1)
        beams = [(0.0, [1], h, ctx)]
        done = []
        for _ in range(max_len):
            new = []
            for score, seq, h, ctx in beams:
                o, h2, c2 = self.step(torch.tensor([seq[-1]], device=x.device), h, ctx, mem)
                lp, ix = o.log_softmax(-1)[0].topk(k)
                new += [(score + l, seq + [t], h2, c2) for l, t in zip(lp.tolist(), ix.tolist())]
            new.sort(key=lambda b: b[0], reverse=True)
            beams = []
            for b in new[:k]:
                (done if b[1][-1] == 2 else beams).append(b)
            if len(done) >= k or not beams:
                break
        best = max(done or beams, key=lambda b: b[0] / len(b[1]))
        return [t for t in best[1][1:] if t != 2]


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    itos = json.load(open(os.path.join(args.data, "vocab.json")))
    stoi = {t: i for i, t in enumerate(itos)}
    train, val = Split(args.data, "train", stoi, args.max_len), Split(args.data, "val", stoi, args.max_len)
    sampler = DistributedSampler(train, shuffle=True)
    train_dl = DataLoader(train, args.bs, sampler=sampler, collate_fn=collate, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val, args.bs, sampler=DistributedSampler(val, shuffle=False), collate_fn=collate,
                        num_workers=4)

    model = DDP(GRUAttn(len(itos), args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    best_path = os.path.join(args.exp, "best.pt")
    os.makedirs(args.exp, exist_ok=True)
    best_nll = float("inf")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x, y[:, :-1]).transpose(1, 2), y[:, 1:], ignore_index=0)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)
        sched.step()

        model.eval()
        s = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                s[0] += F.cross_entropy(model(x, y[:, :-1]).transpose(1, 2), y[:, 1:], ignore_index=0,
                                        reduction="sum")
                s[1] += y[:, 1:].ne(0).sum()
        dist.all_reduce(s)
        nll = (s[0] / s[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: val nll {nll:.4f}", flush=True)
            if nll < best_nll:
                best_nll = nll
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    dist.destroy_process_group()

    # final test decoding on a single GPU
    if rank == 0:
        test = Split(args.data, "test", stoi, args.max_len)
        net = GRUAttn(len(itos), args.hidden).to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        net.eval()
        hyps, refs = [], []
        for i in range(len(test)):
            x, y = test[i]
            pred = net.beam_search(x[None].to(device), args.beam, args.max_len)
            hyps.append(" ".join(itos[t] for t in pred))
            refs.append(" ".join(itos[t] for t in y.tolist()[1:-1]))
        bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="none").score
        em = sum(h == r for h, r in zip(hyps, refs)) / len(refs)
        with open(os.path.join(args.exp, "test_predictions.txt"), "w") as f:
            f.write("\n".join(hyps) + "\n")
        print(f"TEST  BLEU {bleu:.2f}  exact match {em:.4f}", flush=True)


if __name__ == "__main__":
    main()

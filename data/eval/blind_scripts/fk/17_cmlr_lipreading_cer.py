"""Sentence-level Mandarin lip reading on CMLR, character CTC + attention decoder.

Lip ROIs are stored as uint8 .npy (T x 64 x 128, 25 fps). The character vocabulary
is the fixed list shipped with the dataset (vocab.txt, one character per line).

    torchrun --nproc_per_node=8 17_cmlr_lipreading_cer.py --root /data/CMLR --exp exp/cmlr
"""
import argparse
import logging
import os
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("cmlr")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--exp", default="exp/cmlr")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--resume", default="")
    return p.parse_args()


class CMLR(Dataset):
    def __init__(self, root, split, char2id):
        self.root = root
        self.c2i = char2id
        self.items = [l.strip().split("\t") for l in open(os.path.join(root, f"{split}.csv"), encoding="utf-8")]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        roi, text = self.items[i]
        x = torch.from_numpy(np.load(os.path.join(self.root, "roi", roi))).float().div(255.0)
        x = (x - x.mean()) / (x.std() + 1e-6)
        y = torch.tensor([self.c2i.get(c, self.c2i["<unk>"]) for c in text])
        return x, y


def collate(batch):
    xs, ys = zip(*batch)
    return (pad_sequence(xs, True), torch.tensor([x.size(0) for x in xs]),
            pad_sequence(ys, True, padding_value=-1), torch.tensor([y.numel() for y in ys]))


class Encoder(nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv3d(1, 64, (5, 5, 5), (1, 2, 2), (2, 2, 2)), nn.GroupNorm(16, 64), nn.ReLU(True),
            nn.MaxPool3d((1, 2, 2)),
            nn.Conv3d(64, 128, (3, 3, 3), (1, 1, 1), (1, 1, 1)), nn.GroupNorm(16, 128), nn.ReLU(True),
            nn.MaxPool3d((1, 2, 2)),
            nn.Conv3d(128, 256, (3, 3, 3), (1, 1, 1), (1, 1, 1)), nn.GroupNorm(16, 256), nn.ReLU(True),
            nn.MaxPool3d((1, 2, 2)),
            nn.AdaptiveAvgPool3d((None, 1, 1)))
        self.gru = nn.GRU(256, d // 2, num_layers=2, batch_first=True, bidirectional=True, dropout=0.2)

    def forward(self, x, lens):
        f = self.conv(x.unsqueeze(1)).flatten(2).transpose(1, 2)  # B, T, 256
        packed = nn.utils.rnn.pack_padded_sequence(f, lens.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.gru(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.size(1))
        return h


class LipSeq2Seq(nn.Module):
    def __init__(self, vocab, d=512):
        super().__init__()
        self.vocab = vocab
        self.encoder = Encoder(d)
        self.ctc_proj = nn.Linear(d, vocab)
        self.embed = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), 4)
        self.out = nn.Linear(d, vocab)

    def forward(self, x, lens, ys_in):
        h = self.encoder(x, lens)
        mem_mask = torch.arange(h.size(1), device=h.device)[None] >= lens[:, None]
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=h.device), 1)
        d = self.decoder(self.embed(ys_in), h, tgt_mask=causal, memory_key_padding_mask=mem_mask)
        return self.ctc_proj(h).log_softmax(-1), self.out(d)


def io_seqs(ys, ylens, sos, eos):
    yin = [torch.cat([ys.new_tensor([sos]), y[:n]]) for y, n in zip(ys, ylens)]
    yout = [torch.cat([y[:n], ys.new_tensor([eos])]) for y, n in zip(ys, ylens)]
    return pad_sequence(yin, True, padding_value=eos), pad_sequence(yout, True, padding_value=-1)


@torch.no_grad()
def compute_cer(net, loader, device):
    net.eval()
    errors, chars = 0, 0
    for x, lens, ys, ylens in loader:
        h = net.encoder(x.to(device), lens.to(device))
        best = net.ctc_proj(h).argmax(-1).cpu()
        for i in range(best.size(0)):
            hyp = [t for t in torch.unique_consecutive(best[i, : lens[i]]).tolist() if t != 0]
            ref = ys[i, : ylens[i]].tolist()
            errors += editdistance.eval(hyp, ref)
            chars += len(ref)
    stats = torch.tensor([errors, chars], dtype=torch.long)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    net.train()
    return stats[0].item() / max(1, stats[1].item())


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(3407)
    np.random.seed(3407 + rank)

    chars = [l.rstrip("\n") for l in open(os.path.join(args.root, "vocab.txt"), encoding="utf-8")]
    itos = ["<blank>", "<unk>"] + chars + ["<sos/eos>"]
    c2i = {c: i for i, c in enumerate(itos)}
    sos = eos = len(itos) - 1

    train = CMLR(args.root, "train", c2i)
    val = CMLR(args.root, "val", c2i)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    tl = DataLoader(train, args.bs, sampler=sampler, num_workers=8, collate_fn=collate, pin_memory=True, drop_last=True)
    vl = DataLoader(Subset(val, range(rank, len(val), world)), 32, num_workers=4, collate_fn=collate)

    net = LipSeq2Seq(len(itos)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(tl))
    start, best = 0, 1.0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, lens, ys, ylens in tl:
            x, lens, ys, ylens = x.to(device, non_blocking=True), lens.to(device), ys.to(device), ylens.to(device)
            yin, yout = io_seqs(ys, ylens, sos, eos)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctc_lp, att = model(x, lens, yin)
            tgt = torch.cat([y[:n] for y, n in zip(ys, ylens)])
            l_ctc = F.ctc_loss(ctc_lp.float().transpose(0, 1), tgt, lens, ylens, zero_infinity=True)
            l_att = F.cross_entropy(att.float().reshape(-1, att.size(-1)), yout.reshape(-1), ignore_index=-1,
                                    label_smoothing=0.1)
            loss = args.ctc_weight * l_ctc + (1 - args.ctc_weight) * l_att
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        cer = compute_cer(net, vl, device)
        log.info("epoch %d train loss %.4f val CER %.2f%% (%.0fs)", epoch, (run[0] / run[1]).item(), 100 * cer,
                 time.time() - t0)
        if rank == 0:
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": min(best, cer)}
            torch.save(state, os.path.join(args.exp, "last.pt"))
            if cer < best:
                torch.save(state, os.path.join(args.exp, "best.pt"))
        best = min(best, cer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

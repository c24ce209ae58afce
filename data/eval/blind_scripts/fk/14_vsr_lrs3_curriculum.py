"""Visual-only speech recognition on LRS3 (VSR) with a length curriculum.

Frontend initialised from an LRW word-classification checkpoint; conformer encoder,
CTC + attention. Maximum utterance length grows over the first epochs.
Jobs are preempted regularly, so training always resumes from <exp>/checkpoint.pth
when it exists.

    torchrun --nproc_per_node=8 14_vsr_lrs3_curriculum.py --exp exp/vsr_curr \
        --lrw-init pretrained/lrw_resnet18_tcn.pth
"""
import argparse
import math
import os
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models import Conformer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/lrs3")
    p.add_argument("--spm", default="/data/lrs3/spm/unigram5000.model")
    p.add_argument("--exp", required=True)
    p.add_argument("--lrw-init", default=None)
    p.add_argument("--curriculum", default="100,150,300,600", help="max frames per epoch stage")
    p.add_argument("--stage-epochs", type=int, default=5)
    p.add_argument("--epochs", type=int, default=75)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--ctc-weight", type=float, default=0.1)
    return p.parse_args()


class VSRData(Dataset):
    def __init__(self, root, split, sp, max_frames):
        self.root, self.sp = root, sp
        rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(root, f"{split}.tsv"))]
        self.rows = [(r[0], int(r[1]), r[2]) for r in rows if int(r[1]) <= max_frames]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        x = torch.from_numpy(np.load(os.path.join(self.root, path))).float() / 255.0
        return (x - 0.421) / 0.165, torch.tensor(self.sp.encode(text.lower()), dtype=torch.long) + 1


def collate(batch):
    xs, ys = zip(*batch)
    return (pad_sequence(xs, True), torch.tensor([x.size(0) for x in xs]),
            pad_sequence(ys, True), torch.tensor([y.numel() for y in ys]))


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.frontend3D = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                        nn.BatchNorm3d(64), nn.PReLU(64), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r = torchvision.models.resnet18()
        self.trunk = nn.Sequential(r.layer1, r.layer2, r.layer3, r.layer4, nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.frontend3D(x.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return self.trunk(x).view(b, t, 512)


class VSRModel(nn.Module):
    def __init__(self, vocab, d=768):
        super().__init__()
        self.vocab = vocab
        self.frontend = Frontend()
        self.proj = nn.Linear(512, d)
        self.encoder = Conformer(input_dim=d, num_heads=12, ffn_dim=3072, num_layers=12, depthwise_conv_kernel_size=31)
        self.embed = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 12, 3072, 0.1, batch_first=True), 6)
        self.ctc = nn.Linear(d, vocab)
        self.out = nn.Linear(d, vocab)

    def encode(self, x, lens):
        return self.encoder(self.proj(self.frontend(x)), lens)

    def forward(self, x, lens, ys_in):
        enc, lens = self.encode(x, lens)
        mask = torch.arange(enc.size(1), device=x.device)[None] >= lens[:, None]
        L = ys_in.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), 1)
        dec = self.decoder(self.embed(ys_in), enc, tgt_mask=causal, memory_key_padding_mask=mask)
        return self.ctc(enc), self.out(dec)


def make_loaders(args, sp, max_frames, world, rank):
    train = VSRData(args.data, "train", sp, max_frames)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.batch_size, sampler=sampler, num_workers=8, collate_fn=collate,
                        pin_memory=True, drop_last=True)
    return loader, sampler


def curriculum_max(args, epoch):
    stages = [int(s) for s in args.curriculum.split(",")]
    return stages[min(epoch // args.stage_epochs, len(stages) - 1)]


@torch.no_grad()
def greedy_wer(net, loader, sp, device):
    net.eval()
    e = n = 0
    for x, lens, ys, ylens in loader:
        enc, elens = net.encode(x.to(device), lens.to(device))
        pred = net.ctc(enc).argmax(-1).cpu()
        for i in range(pred.size(0)):
            ids = [t - 1 for t in torch.unique_consecutive(pred[i, : elens[i]]).tolist() if 0 < t < net.vocab - 1]
            ref = sp.decode((ys[i, : ylens[i]] - 1).tolist()).split()
            e += editdistance.eval(sp.decode(ids).split(), ref)
            n += len(ref)
    net.train()
    return e / max(1, n)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    vocab = sp.get_piece_size() + 2
    sos = vocab - 1
    net = VSRModel(vocab).to(device)
    if args.lrw_init:
        lrw = torch.load(args.lrw_init, map_location="cpu")
        lrw = {k.replace("module.", ""): v for k, v in lrw["model_state_dict"].items()}
        fe = {k[len("frontend3D."):]: v for k, v in lrw.items() if k.startswith("frontend3D.")}
        net.frontend.frontend3D.load_state_dict(fe)
        tr = {k[len("trunk."):]: v for k, v in lrw.items() if k.startswith("trunk.")}
        net.frontend.trunk.load_state_dict(tr, strict=False)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.03)

    valid = VSRData(args.data, "valid", sp, 10 ** 6)
    valid_loader = DataLoader(valid, 8, num_workers=4, collate_fn=collate)

    ckpt_path = os.path.join(args.exp, "checkpoint.pth")
    start_epoch, best = 0, float("inf")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_wer"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}", flush=True)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    cur_max, loader, sampler = None, None, None
    for epoch in range(start_epoch, args.epochs):
        m = curriculum_max(args, epoch)
        if m != cur_max:
            cur_max = m
            loader, sampler = make_loaders(args, sp, m, world, rank)
        sampler.set_epoch(epoch)
        steps = len(loader)
        t0 = time.time()
        for it, (x, lens, ys, ylens) in enumerate(loader):
            # per-step lr: linear warmup then cosine over the whole run
            prog = (epoch + it / steps) / args.epochs
            warm = (epoch + it / steps) / args.warmup_epochs
            lr = args.lr * min(1.0, warm) * 0.5 * (1 + math.cos(math.pi * prog))
            for g in opt.param_groups:
                g["lr"] = lr

            x, lens, ys, ylens = x.to(device, non_blocking=True), lens.to(device), ys.to(device), ylens.to(device)
            ys_in = torch.cat([torch.full_like(ys[:, :1], sos), ys], 1)
            ys_out = F.pad(ys, (0, 1), value=0)
            ys_out[torch.arange(ys.size(0)), ylens] = sos
            ys_out = ys_out.masked_fill(ys_out == 0, -1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ctc_logits, att_logits = model(x, lens, ys_in)
            targets = torch.cat([y[:n] for y, n in zip(ys, ylens)])
            l_ctc = F.ctc_loss(ctc_logits.float().log_softmax(-1).transpose(0, 1), targets, lens, ylens, zero_infinity=True)
            l_att = F.cross_entropy(att_logits.float().transpose(1, 2), ys_out, ignore_index=-1, label_smoothing=0.1)
            loss = args.ctc_weight * l_ctc + (1 - args.ctc_weight) * l_att
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} [{it}/{steps}] maxT {cur_max} ctc {l_ctc.item():.3f} att {l_att.item():.3f} lr {lr:.2e}",
                      flush=True)

        if rank == 0:
            wer = greedy_wer(net, valid_loader, sp, device)
            best = min(best, wer)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s, valid WER {100 * wer:.2f}", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "best_wer": best},
                       ckpt_path)
            if wer == best:
                torch.save(net.state_dict(), os.path.join(args.exp, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

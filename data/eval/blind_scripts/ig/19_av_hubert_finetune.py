"""Fine-tune a self-supervised audio-visual encoder (AV-HuBERT-like, exported to a plain state dict)
for AVSR with a CTC + attention head on LRS3 433h.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        19_av_hubert_finetune.py --pretrained /shared/models/avhubert_base_export.pt \
        --manifest /shared/lrs3/433h --save-dir /shared/exp/avhubert_ft_433h
"""
import argparse
import logging
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
logger = logging.getLogger("avhubert_ft")


class ManifestAV(Dataset):
    """fairseq-style manifest: first line root, then id \t video \t audio(fbank .npy) \t n_frames; labels in .wrd"""

    def __init__(self, manifest_dir, split, sp, train):
        with open(os.path.join(manifest_dir, f"{split}.tsv")) as f:
            root = f.readline().strip()
            rows = [l.rstrip("\n").split("\t") for l in f]
        with open(os.path.join(manifest_dir, f"{split}.wrd")) as f:
            words = [l.strip() for l in f]
        assert len(rows) == len(words)
        self.items = [(os.path.join(root, r[1]), os.path.join(root, r[2]), w) for r, w in zip(rows, words)]
        self.sp, self.train = sp, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vpath, apath, text = self.items[i]
        v = np.load(vpath)
        a = np.load(apath).astype(np.float32)
        o = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, o[0]:o[0] + 88, o[1]:o[1] + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        # stack 4 fbank frames -> 25 fps, like AV-HuBERT
        n = len(v)
        a = np.pad(a, ((0, max(0, 4 * n - len(a))), (0, 0)))[: 4 * n].reshape(n, 4 * a.shape[1])
        a = (a - a.mean(0)) / (a.std(0) + 1e-5)
        return torch.from_numpy(v), torch.from_numpy(a), torch.tensor(self.sp.encode(text)) + 1, text


def collate(b):
    v, a, y, t = zip(*b)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class AVEncoder(nn.Module):
    """Same layout as the exported pretrained encoder (keys: feat_v.*, feat_a.*, proj.*, layers.*, ln.*)."""

    def __init__(self, d=768, layers=12):
        super().__init__()
        self.feat_v = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64), nn.PReLU(64),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
            nn.Conv3d(64, 256, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(256), nn.PReLU(256),
            nn.Conv3d(256, 512, (1, 3, 3), (1, 2, 2), (0, 1, 1), bias=False), nn.BatchNorm3d(512), nn.PReLU(512))
        self.feat_a = nn.Linear(4 * 26, 512)
        self.proj = nn.Linear(1024, d)
        self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True),
                                            layers)
        self.ln = nn.LayerNorm(d)

    def forward(self, v, a, lens, mask_prob=0.0):
        t = v.size(1)
        hv = self.feat_v(v.unsqueeze(1)).mean((3, 4)).transpose(1, 2)
        ha = self.feat_a(a)
        x = self.proj(torch.cat([hv, ha], -1))
        if mask_prob > 0:
            keep = (torch.rand(x.shape[:2], device=x.device) >= mask_prob).unsqueeze(-1)
            x = x * keep
        pad = torch.arange(t, device=x.device)[None] >= lens[:, None]
        return self.ln(self.layers(x, src_key_padding_mask=pad)), pad


class AVSRFinetune(nn.Module):
    def __init__(self, vocab, d=768):
        super().__init__()
        self.encoder = AVEncoder(d)
        self.ctc_proj = nn.Linear(d, vocab)
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(512, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True), 6)
        self.out = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def forward(self, v, a, lens, y, ylens, ctc_w=0.3, mask_prob=0.0):
        mem, pad = self.encoder(v, a, lens, mask_prob)
        l_ctc = F.ctc_loss(self.ctc_proj(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens,
                           zero_infinity=True)
        yi = F.pad(y, (1, 0), value=self.eos)
        yo = F.pad(y, (0, 1))
        yo[torch.arange(len(y)), ylens] = self.eos
        yo = yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)
        L = yi.size(1)
        h = self.decoder(self.embed(yi) + self.pos.weight[:L], mem, memory_key_padding_mask=pad,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        l_att = F.cross_entropy(self.out(h).float().transpose(1, 2), yo, ignore_index=-100, label_smoothing=0.1)
        return ctc_w * l_ctc + (1 - ctc_w) * l_att


def tri_stage(step, total, warm=0.1, hold=0.4):
    w, h = int(total * warm), int(total * hold)
    if step < w:
        return 0.01 + 0.99 * step / max(1, w)
    if step < w + h:
        return 1.0
    return math.exp(math.log(0.05) * (step - w - h) / max(1, total - w - h))


def save_checkpoint(path, model, opt, sched, epoch, num_updates, wer):
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
                "epoch": epoch, "num_updates": num_updates, "valid_wer": wer}, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--spm", default="/shared/lrs3/spm1000/spm_unigram1000.model")
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--max-epoch", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mask-prob", type=float, default=0.3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(1337)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    V = sp.get_piece_size() + 2
    train_ds = ManifestAV(args.manifest, "train", sp, True)
    valid_ds = ManifestAV(args.manifest, "valid", sp, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), args.batch_size, num_workers=4,
                          collate_fn=collate)

    model = AVSRFinetune(V)
    enc_sd = torch.load(args.pretrained, map_location="cpu")
    missing, unexpected = model.encoder.load_state_dict(enc_sd, strict=False)
    logger.info("pretrained encoder loaded: %d missing, %d unexpected", len(missing), len(unexpected))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    total = args.max_epoch * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: tri_stage(s, total))
    os.makedirs(args.save_dir, exist_ok=True)

    num_updates, best_wer = 0, float("inf")
    for epoch in range(1, args.max_epoch + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for v, a, lens, y, ylens, _ in train_dl:
            v, a, lens, y, ylens = (x.to(device, non_blocking=True) for x in (v, a, lens, y, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, y, ylens, mask_prob=args.mask_prob)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            num_updates += 1
            if num_updates % 200 == 0:
                logger.info("epoch %03d | updates %d | loss %.3f | lr %.2e | %.1fs", epoch, num_updates, loss.item(),
                            sched.get_last_lr()[0], time.time() - t0)

        net = model.module
        net.eval()
        c = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for v, a, lens, _, _, texts in valid_dl:
                mem, _ = net.encoder(v.to(device), a.to(device), lens.to(device))
                for row, n, ref in zip(net.ctc_proj(mem).argmax(-1).tolist(), lens.tolist(), texts):
                    toks, prev = [], None
                    for t in row[:n]:
                        if t != prev and 0 < t < V - 1:
                            toks.append(t - 1)
                        prev = t
                    c[0] += editdistance.eval(sp.decode(toks).split(), ref.split())
                    c[1] += len(ref.split())
        dist.all_reduce(c)
        net.train()
        wer = (c[0] / c[1]).item()
        logger.info("epoch %03d | valid WER %.2f", epoch, 100 * wer)

        save_checkpoint(os.path.join(args.save_dir, "checkpoint_last.pt"), model, opt, sched, epoch, num_updates, wer)
        if wer < best_wer:
            best_wer = wer
            save_checkpoint(os.path.join(args.save_dir, "checkpoint_best.pt"), model, opt, sched, epoch,
                            num_updates, wer)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

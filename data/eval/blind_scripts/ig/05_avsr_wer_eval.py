"""
AV-ASR fine-tuning on LRS2 (raw waveform + lip ROI), hybrid CTC/attention.

Validation every epoch decodes the full val set with attention beam search (beam 10) and
reports corpus WER over all ranks.

usage: torchrun --standalone --nproc_per_node=4 05_avsr_wer_eval.py --data /data/lrs2 --init ckpt/lrs3_avsr.pt
"""
import argparse
import math
import os

import editdistance
import numpy as np
import sentencepiece as spm
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SR = 16000
SAMPLES_PER_FRAME = SR // 25


class LRS2(Dataset):
    def __init__(self, root, split, sp, noise_files=None):
        self.root, self.sp, self.split = root, sp, split
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.split()[0] for l in f if l.strip()]
        self.noise_files = noise_files or []

    def __len__(self):
        return len(self.ids)

    def _text(self, uid):
        with open(os.path.join(self.root, "text", uid + ".txt")) as f:
            return f.readline().split(":", 1)[1].strip().lower()

    def __getitem__(self, i):
        uid = self.ids[i]
        roi = np.load(os.path.join(self.root, "roi", uid + ".npy"))[:, 4:92, 4:92]
        wav, _ = sf.read(os.path.join(self.root, "wav", uid + ".wav"), dtype="float32")
        n = roi.shape[0] * SAMPLES_PER_FRAME
        wav = np.pad(wav, (0, max(0, n - len(wav))))[:n]
        if self.split == "train" and self.noise_files and np.random.rand() < 0.5:
            noise, _ = sf.read(self.noise_files[np.random.randint(len(self.noise_files))], dtype="float32")
            noise = np.resize(noise, n)
            snr = np.random.choice([-5, 0, 5, 10, 15, 20])
            scale = np.sqrt((wav ** 2).mean() / (10 ** (snr / 10) * (noise ** 2).mean() + 1e-8))
            wav = wav + scale * noise
        wav = (wav - wav.mean()) / (wav.std() + 1e-5)
        text = self._text(uid)
        return (torch.from_numpy((roi.astype(np.float32) / 255.0 - 0.421) / 0.165), torch.from_numpy(wav),
                torch.tensor(self.sp.encode(text)) + 1, text)


def collate(batch):
    v, a, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(v, True), nn.utils.rnn.pad_sequence(a, True),
            torch.tensor([x.size(0) for x in v]), nn.utils.rnn.pad_sequence(y, True),
            torch.tensor([x.size(0) for x in y]), list(t))


def conv_bn(cin, cout, k, s, dims):
    Conv, BN = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
    return nn.Sequential(Conv(cin, cout, k, s, k // 2, bias=False), BN(cout), nn.ReLU(inplace=True))


class AudioEncoder(nn.Module):
    """1D conv stack on raw waveform, 640 samples -> one 25 fps frame."""

    def __init__(self, d):
        super().__init__()
        self.net = nn.Sequential(conv_bn(1, 64, 80, 4, 1), conv_bn(64, 64, 3, 1, 1), conv_bn(64, 128, 3, 2, 1),
                                 conv_bn(128, 256, 3, 2, 1), conv_bn(256, 512, 3, 2, 1))
        self.proj = nn.Linear(512, d)

    def forward(self, wav, t):
        x = self.net(wav.unsqueeze(1))                       # B, 512, N/32
        x = F.adaptive_avg_pool1d(x, t).transpose(1, 2)
        return self.proj(x)


class VideoEncoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
                                  nn.BatchNorm3d(64), nn.ReLU(inplace=True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.res = nn.Sequential(conv_bn(64, 64, 3, 1, 2), conv_bn(64, 128, 3, 2, 2),
                                 conv_bn(128, 256, 3, 2, 2), conv_bn(256, 512, 3, 2, 2))
        self.proj = nn.Linear(512, d)

    def forward(self, v):
        b, t = v.shape[:2]
        x = self.stem(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        return self.proj(self.res(x).mean((2, 3)).view(b, t, -1))


class AVSR(nn.Module):
    def __init__(self, vocab, d=512, enc_layers=12, dec_layers=6):
        super().__init__()
        self.venc, self.aenc = VideoEncoder(d), AudioEncoder(d)
        self.fuse = nn.Linear(2 * d, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True), enc_layers)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), dec_layers)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(1024, d)
        self.ctc_out, self.att_out = nn.Linear(d, vocab), nn.Linear(d, vocab)
        self.sos = self.eos = vocab - 1

    def encode(self, v, a, lens):
        t = v.size(1)
        x = self.fuse(torch.cat([self.venc(v), self.aenc(a, t)], -1))
        x = x + self.pos(torch.arange(t, device=x.device))
        mask = torch.arange(t, device=x.device)[None] >= lens[:, None]
        return self.enc(x, src_key_padding_mask=mask), mask

    def decode_step(self, ys, mem, mem_mask):
        L = ys.size(1)
        h = self.emb(ys) + self.pos(torch.arange(L, device=ys.device))
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=ys.device)
        return self.att_out(self.dec(h, mem, tgt_mask=causal, memory_key_padding_mask=mem_mask))

    def forward(self, v, a, lens, ys, ylens, ctc_w=0.1):
        mem, mask = self.encode(v, a, lens)
        ctc = F.ctc_loss(self.ctc_out(mem).float().log_softmax(-1).transpose(0, 1), ys, lens, ylens,
                         zero_infinity=True)
        ys_in = F.pad(ys, (1, 0), value=self.sos)
        tgt = F.pad(ys, (0, 1), value=0)
        tgt[torch.arange(ys.size(0)), ylens] = self.eos
        tgt[torch.arange(tgt.size(1), device=ys.device)[None] > ylens[:, None]] = -100
        att = F.cross_entropy(self.decode_step(ys_in, mem, mask).float().transpose(1, 2), tgt,
                              ignore_index=-100, label_smoothing=0.1)
        return ctc_w * ctc + (1 - ctc_w) * att

    @torch.no_grad()
    def beam_search(self, v, a, beam=10, max_len=150, len_pen=0.5):
        mem, mask = self.encode(v, a, torch.tensor([v.size(1)], device=v.device))
        hyps = [([self.sos], 0.0)]
        finished = []
        for _ in range(max_len):
            ys = torch.tensor([h for h, _ in hyps], device=v.device)
            logp = self.decode_step(ys, mem.expand(len(hyps), -1, -1), mask.expand(len(hyps), -1))[:, -1]
            logp = logp.float().log_softmax(-1)
            cand = []
            for (h, s), lp in zip(hyps, logp):
                top = lp.topk(beam)
                cand += [(h + [k], s + val) for val, k in zip(top.values.tolist(), top.indices.tolist())]
            cand.sort(key=lambda c: c[1], reverse=True)
            hyps = []
            for h, s in cand[:beam]:
                (finished if h[-1] == self.eos else hyps).append((h, s))
            if not hyps or len(finished) >= beam:
                break
        finished = finished or hyps
        best = max(finished, key=lambda c: c[1] / (len(c[0]) ** len_pen))
        return [t for t in best[0][1:] if t != self.eos and t != 0]


def validate(model, loader, sp, device):
    model.eval()
    total_err, total_words = 0, 0
    for v, a, lens, _, _, texts in loader:
        for j in range(v.size(0)):
            n = lens[j].item()
            with torch.autocast("cuda", dtype=torch.float16):
                hyp = model.beam_search(v[j:j + 1, :n].to(device), a[j:j + 1, : n * SAMPLES_PER_FRAME].to(device))
            ref = texts[j].split()
            total_err += editdistance.eval(sp.decode([t - 1 for t in hyp]).split(), ref)
            total_words += len(ref)
    stats = torch.tensor([total_err, total_words], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--spm", default="spm/lrs_unigram1000.model")
    p.add_argument("--init", default=None, help="LRS3-pretrained AVSR checkpoint")
    p.add_argument("--noise-list", default=None)
    p.add_argument("--out", default="exp/lrs2_ft")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    vocab = sp.get_piece_size() + 2
    noise = [l.strip() for l in open(args.noise_list)] if args.noise_list else None
    train = LRS2(args.data, "train", sp, noise)
    val = LRS2(args.data, "val", sp)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=8,
                            num_workers=args.workers, collate_fn=collate)

    net = AVSR(vocab)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        missing, unexpected = net.load_state_dict(sd["model"], strict=False)
        if rank == 0:
            print(f"init from {args.init}: missing {len(missing)} unexpected {len(unexpected)}")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05,
                                                anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.out, exist_ok=True)

    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (v, a, lens, ys, ylens, _) in enumerate(train_loader):
            v, a = v.to(device, non_blocking=True), a.to(device, non_blocking=True)
            lens, ys, ylens = lens.to(device), ys.to(device), ylens.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(v, a, lens, ys, ylens)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        wer = validate(net, val_loader, sp, device)
        if rank == 0:
            print(f"== epoch {epoch} val WER {wer * 100:.2f}%", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "wer": wer}, os.path.join(args.out, "last.pt"))
            if wer < best:
                best = wer
                torch.save({"model": net.state_dict(), "epoch": epoch, "wer": wer}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Audio-visual speech recognition trainer (LRS3), preemptible-cluster friendly.

The job is resubmitted by the scheduler after preemption, so it always tries to resume from
<exp>/latest.pt. Checkpoints are written every --save-every steps and at the end of each epoch.

    torchrun --nproc_per_node=8 07_avsr_resume_training.py --exp exp/avsr_base --data /mnt/lrs3
"""
import argparse
import logging
import math
import os
import signal
import sys

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

log = logging.getLogger(__name__)


class AVClips(Dataset):
    def __init__(self, root, split, sp):
        self.root, self.sp, self.split = root, sp, split
        with open(os.path.join(root, f"{split}.csv")) as f:
            next(f)
            self.rows = [line.rstrip("\n").split(",", 2) for line in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, n, text = self.rows[i]
        v = np.load(os.path.join(self.root, "lips", uid + ".npy"))
        a = np.load(os.path.join(self.root, "fbank", uid + ".npy"))
        if self.split == "train":
            oy, ox = np.random.randint(0, 9, 2)
        else:
            oy = ox = 4
        v = v[:, oy:oy + 88, ox:ox + 88].astype(np.float32) / 255.0
        a = a[: 4 * v.shape[0]]
        if a.shape[0] < 4 * v.shape[0]:
            a = np.pad(a, ((0, 4 * v.shape[0] - a.shape[0]), (0, 0)))
        y = [t + 1 for t in self.sp.encode(text)]
        return torch.from_numpy((v - 0.421) / 0.165), torch.from_numpy(a.astype(np.float32)), torch.tensor(y), text


def collate(b):
    v, a, y, t = zip(*b)
    pad = nn.utils.rnn.pad_sequence
    return pad(v, True), pad(a, True), torch.tensor([len(x) for x in v]), pad(y, True), torch.tensor([len(x) for x in y]), t


class TemporalConvFrontend(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.video = nn.Sequential(
            nn.Conv3d(1, 48, (5, 7, 7), (1, 2, 2), (2, 3, 3)), nn.BatchNorm3d(48), nn.GELU(),
            nn.Conv3d(48, 96, (3, 5, 5), (1, 2, 2), (1, 2, 2)), nn.BatchNorm3d(96), nn.GELU(),
            nn.Conv3d(96, 192, (3, 3, 3), (1, 2, 2), 1), nn.BatchNorm3d(192), nn.GELU(),
            nn.Conv3d(192, 384, (3, 3, 3), (1, 2, 2), 1), nn.BatchNorm3d(384), nn.GELU(),
        )
        self.audio = nn.Sequential(nn.Conv1d(80, d, 3, 2, 1), nn.GELU(), nn.Conv1d(d, d, 3, 2, 1), nn.GELU())
        self.proj = nn.Linear(384 + d, d)

    def forward(self, v, a):
        t = v.size(1)
        fv = self.video(v.unsqueeze(1)).mean((-1, -2)).transpose(1, 2)
        fa = self.audio(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        return self.proj(torch.cat([fv, fa], -1))


class AVSR(nn.Module):
    def __init__(self, vocab, d=384, n_enc=12, n_dec=6):
        super().__init__()
        self.front = TemporalConvFrontend(d)
        self.pos = nn.Parameter(torch.zeros(1, 2048, d))
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 6, 4 * d, 0.1, "gelu", batch_first=True,
                                                                        norm_first=True), n_enc)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 6, 4 * d, 0.1, "gelu", batch_first=True,
                                                                        norm_first=True), n_dec)
        self.tok = nn.Embedding(vocab, d)
        self.ctc_proj = nn.Linear(d, vocab)
        self.dec_proj = nn.Linear(d, vocab)
        self.sos_eos = vocab - 1
        nn.init.trunc_normal_(self.pos, std=0.02)

    def encode(self, v, a, lens):
        x = self.front(v, a)
        x = x + self.pos[:, : x.size(1)]
        mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        return self.encoder(x, src_key_padding_mask=mask), mask

    def forward(self, v, a, lens, y, ylens, ctc_weight=0.3):
        mem, mask = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc_proj(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens,
                           zero_infinity=True)
        y_in = F.pad(y, (1, 0), value=self.sos_eos)
        y_out = F.pad(y, (0, 1), value=-100)
        y_out[torch.arange(y.size(0)), ylens] = self.sos_eos
        y_out = y_out.masked_fill(F.pad(y == 0, (0, 1), value=True) & (y_out != self.sos_eos), -100)
        L = y_in.size(1)
        h = self.decoder(self.tok(y_in) + self.pos[:, :L], mem,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device),
                         memory_key_padding_mask=mask)
        l_att = F.cross_entropy(self.dec_proj(h).float().flatten(0, 1), y_out.flatten(), ignore_index=-100,
                                label_smoothing=0.1)
        return ctc_weight * l_ctc + (1 - ctc_weight) * l_att


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.sp = spm.SentencePieceProcessor(model_file=args.spm)
        self.vocab = self.sp.get_piece_size() + 2

        self.train_set = AVClips(args.data, "train", self.sp)
        self.valid_set = AVClips(args.data, "valid", self.sp)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, seed=args.seed, drop_last=True)
        self.train_loader = DataLoader(self.train_set, args.batch_size, sampler=self.sampler, num_workers=8,
                                       collate_fn=collate, pin_memory=True, drop_last=True)
        shard = range(self.rank, len(self.valid_set), self.world)
        self.valid_loader = DataLoader(Subset(self.valid_set, shard), 16, num_workers=4, collate_fn=collate)

        torch.manual_seed(args.seed)
        model = AVSR(self.vocab)
        self.epoch, self.step, self.best = 0, 0, math.inf
        ckpt = None
        latest = os.path.join(args.exp, "latest.pt")
        if os.path.exists(latest):
            ckpt = torch.load(latest, map_location="cpu")
            model.load_state_dict(ckpt["model"])
            self.epoch, self.step, self.best = ckpt["epoch"], ckpt["step"], ckpt["best"]
            log.info("resuming from %s (epoch %d, step %d)", latest, self.epoch, self.step)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
        total = args.epochs * len(self.train_loader)
        warm = int(0.08 * total)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / (total - warm))))))
        if ckpt is not None:
            self.opt.load_state_dict(ckpt["optimizer"])
            self.sched.load_state_dict(ckpt["scheduler"])
        self.stop_requested = False
        signal.signal(signal.SIGUSR1, self._on_preempt)

    def _on_preempt(self, signum, frame):
        self.stop_requested = True

    def save(self, name, epoch_done):
        if self.rank != 0:
            return
        os.makedirs(self.args.exp, exist_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                 "scheduler": self.sched.state_dict(), "epoch": epoch_done, "step": self.step, "best": self.best}
        tmp = os.path.join(self.args.exp, name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.args.exp, name))

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        err = torch.zeros(2, device=self.device)
        for v, a, lens, _, _, texts in self.valid_loader:
            v, a, lens = v.to(self.device), a.to(self.device), lens.to(self.device)
            mem, _ = net.encode(v, a, lens)
            pred = net.ctc_proj(mem).argmax(-1)
            for p, n, ref in zip(pred, lens.tolist(), texts):
                ids = [t - 1 for t in torch.unique_consecutive(p[:n]).tolist() if 0 < t < self.vocab - 1]
                err[0] += editdistance.eval(self.sp.decode(ids).split(), ref.split())
                err[1] += len(ref.split())
        dist.all_reduce(err)
        net.train()
        return (err[0] / err[1]).item()

    def fit(self):
        a = self.args
        for epoch in range(self.epoch, a.epochs):
            self.sampler.set_epoch(epoch)
            self.model.train()
            for v, au, lens, y, ylens, _ in self.train_loader:
                v, au, lens = v.to(self.device, non_blocking=True), au.to(self.device, non_blocking=True), lens.to(self.device)
                y, ylens = y.to(self.device), ylens.to(self.device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = self.model(v, au, lens, y, ylens)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
                self.opt.step()
                self.sched.step()
                self.step += 1
                if self.rank == 0 and self.step % 100 == 0:
                    log.info("epoch %d step %d loss %.4f lr %.3e", epoch, self.step, loss.item(),
                             self.sched.get_last_lr()[0])
                if self.step % a.save_every == 0:
                    self.save("latest.pt", epoch)
                    dist.barrier()
                flag = torch.tensor([float(self.stop_requested)], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    self.save("latest.pt", epoch)
                    dist.barrier()
                    log.info("preempted, checkpoint written at step %d", self.step)
                    return False
            wer = self.validate()
            if wer < self.best:
                self.best = wer
                self.save("best.pt", epoch + 1)
            self.save("latest.pt", epoch + 1)
            if self.rank == 0:
                log.info("epoch %d done, valid WER %.2f%% (best %.2f%%)", epoch, 100 * wer, 100 * self.best)
            dist.barrier()
        return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--spm", default="spm/unigram1000.model")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    trainer = Trainer(args)
    if trainer.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    finished = trainer.fit()
    dist.destroy_process_group()
    sys.exit(0 if finished else 3)


if __name__ == "__main__":
    main()

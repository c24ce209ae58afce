"""Fine-tune an LRS3-pretrained AVSR model on LRS2 (main split), selecting the checkpoint by val WER.

Config is an OmegaConf yaml; any key can be overridden on the command line (dotlist):
    torchrun --nproc_per_node=8 17_avsr_finetune_lrs2.py conf/ft_lrs2.yaml optim.lr=2e-4 data.batch_size=12
"""
import math
import os
import sys
import time

import jiwer
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT = OmegaConf.create({
    "data": {"root": "/data/LRS2", "spm": "spm/unigram1000.model", "batch_size": 16, "workers": 8},
    "model": {"d": 512, "enc_layers": 12, "dec_layers": 6, "init": "ckpt/lrs3_avsr_base.pt"},
    "optim": {"lr": 3e-4, "weight_decay": 0.01, "epochs": 15, "warmup_steps": 1000, "ctc_weight": 0.1},
    "exp_dir": "exp/ft_lrs2",
})


class LRS2Main(Dataset):
    def __init__(self, root, split, sp, train):
        self.root, self.sp, self.train = root, sp, train
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.split()[0] for l in f if l.strip()]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        uid = self.ids[i]
        v = np.load(os.path.join(self.root, "roi", uid + ".npy"))
        a = np.load(os.path.join(self.root, "fbank", uid + ".npy"))
        with open(os.path.join(self.root, "main", uid + ".txt")) as f:
            text = f.readline().split(":", 1)[1].strip().lower()
        o = np.random.randint(0, 9, 2) if self.train else (4, 4)
        v = (v[:, o[0]:o[0] + 88, o[1]:o[1] + 88].astype(np.float32) / 255.0 - 0.421) / 0.165
        need = 4 * len(v)
        a = np.pad(a, ((0, max(0, need - len(a))), (0, 0)))[:need].astype(np.float32)
        if self.train and np.random.rand() < 0.5:
            t0 = np.random.randint(0, max(1, need - 40))
            a[t0:t0 + np.random.randint(0, 40)] = 0.0
        return torch.from_numpy(v), torch.from_numpy(a), torch.tensor(self.sp.encode(text)) + 1, text


def collate(b):
    v, a, y, t = zip(*b)
    ps = nn.utils.rnn.pad_sequence
    return ps(v, True), ps(a, True), torch.tensor([len(x) for x in v]), ps(y, True), torch.tensor([len(x) for x in y]), t


class ResStage(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.sc(x))


class AVSR(nn.Module):
    def __init__(self, vocab, d, enc_layers, dec_layers):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64),
                                  nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.res = nn.Sequential(ResStage(64, 128, 2), ResStage(128, 256, 2), ResStage(256, 512, 2))
        self.vproj = nn.Linear(512, d)
        self.aproj = nn.Sequential(nn.Conv1d(80, d, 3, 2, 1), nn.GELU(), nn.Conv1d(d, d, 3, 2, 1), nn.GELU())
        self.fuse = nn.Linear(2 * d, d)
        self.pos = nn.Embedding(1024, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True),
                                         enc_layers)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True),
                                         dec_layers)
        self.emb = nn.Embedding(vocab, d)
        self.ctc = nn.Linear(d, vocab)
        self.lm_head = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def encode(self, v, a, lens):
        b, t = v.shape[:2]
        hv = self.stem(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        hv = self.vproj(F.adaptive_avg_pool2d(self.res(hv), 1).flatten(1)).view(b, t, -1)
        ha = self.aproj(a.transpose(1, 2)).transpose(1, 2)[:, :t]
        x = self.fuse(torch.cat([hv, ha], -1)) + self.pos.weight[:t]
        m = torch.arange(t, device=v.device)[None] >= lens[:, None]
        return self.enc(x, src_key_padding_mask=m), m

    def forward(self, v, a, lens, y, ylens, ctc_w):
        mem, m = self.encode(v, a, lens)
        l_ctc = F.ctc_loss(self.ctc(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens, zero_infinity=True)
        yi = F.pad(y, (1, 0), value=self.eos)
        yo = F.pad(y, (0, 1))
        yo[torch.arange(len(y)), ylens] = self.eos
        yo = yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)
        L = yi.size(1)
        h = self.dec(self.emb(yi) + self.pos.weight[:L], mem, memory_key_padding_mask=m,
                     tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        l_att = F.cross_entropy(self.lm_head(h).float().transpose(1, 2), yo, ignore_index=-100, label_smoothing=0.1)
        return ctc_w * l_ctc + (1 - ctc_w) * l_att


@torch.no_grad()
def greedy_transcribe(net, v, a, lens, sp, vocab):
    mem, _ = net.encode(v, a, lens)
    out = []
    for row, n in zip(net.ctc(mem).argmax(-1).tolist(), lens.tolist()):
        toks, prev = [], -1
        for t in row[:n]:
            if t != prev and 0 < t < vocab - 1:
                toks.append(t - 1)
            prev = t
        out.append(sp.decode(toks))
    return out


def main():
    cfg = DEFAULT
    if len(sys.argv) > 1:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(sys.argv[1]), OmegaConf.from_dotlist(sys.argv[2:]))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    sp = spm.SentencePieceProcessor(model_file=cfg.data.spm)
    V = sp.get_piece_size() + 2
    train_ds = LRS2Main(cfg.data.root, "train", sp, True)
    val_ds = LRS2Main(cfg.data.root, "val", sp, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.data.batch_size, sampler=train_sampler, num_workers=cfg.data.workers,
                          collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, cfg.data.batch_size, sampler=val_sampler, num_workers=cfg.data.workers,
                        collate_fn=collate)

    net = AVSR(V, cfg.model.d, cfg.model.enc_layers, cfg.model.dec_layers)
    if cfg.model.init:
        sd = torch.load(cfg.model.init, map_location="cpu")
        net.load_state_dict(sd["model"] if "model" in sd else sd)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    total = cfg.optim.epochs * len(train_dl)
    w = cfg.optim.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / w, 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, s - w) / max(1, total - w))))))
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.exp_dir, "config.yaml"))

    best_wer = float("inf")
    for epoch in range(cfg.optim.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (v, a, lens, y, ylens, _) in enumerate(train_dl):
            v, a, lens, y, ylens = (x.to(dev, non_blocking=True) for x in (v, a, lens, y, ylens))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, a, lens, y, ylens, cfg.optim.ctc_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[epoch {epoch} it {it}/{len(train_dl)}] loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)

        net.eval()
        hyps, refs = [], []
        for v, a, lens, _, _, texts in val_dl:
            hyps += greedy_transcribe(net, v.to(dev), a.to(dev), lens.to(dev), sp, V)
            refs += list(texts)
        net.train()
        wer = jiwer.wer(refs, hyps)

        if rank == 0:
            print(f"epoch {epoch}: val WER {100 * wer:.2f}% on {len(refs)} utterances", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "wer": wer}, os.path.join(cfg.exp_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save({"model": net.state_dict(), "epoch": epoch, "wer": wer},
                           os.path.join(cfg.exp_dir, "best.pt"))
                print(f"  new best -> {cfg.exp_dir}/best.pt", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Conformer-CTC (torchaudio blocks) with a SentencePiece vocabulary trained on the fly,
per-utterance fbank cache, and activation checkpointing for long utterances.

    torchrun --nproc_per_node=8 17_conformer_ctc_spm_ckpt.py --data data/gigaspeech_m --exp exp/conf_l
"""
import argparse
import datetime
import os

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/gigaspeech_m")
    ap.add_argument("--exp", default="exp/conformer_ctc_l")
    ap.add_argument("--vocab_size", type=int, default=500)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--batch_size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=15000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--act_ckpt", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def read_list(path):
    rows = []
    for line in open(path):
        uid, wav, text = line.rstrip("\n").split("\t")
        rows.append((uid, wav, text.lower()))
    return rows


def ensure_bpe(rows, exp, vocab_size, rank):
    prefix = os.path.join(exp, f"bpe{vocab_size}")
    if rank == 0 and not os.path.exists(prefix + ".model"):
        txt = os.path.join(exp, "bpe_train.txt")
        with open(txt, "w") as f:
            f.writelines(r[2] + "\n" for r in rows)
        spm.SentencePieceTrainer.train(input=txt, model_prefix=prefix, vocab_size=vocab_size,
                                       model_type="unigram", character_coverage=1.0,
                                       input_sentence_size=2_000_000, shuffle_input_sentence=True)
    dist.barrier()
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def ensure_features(rows, feat_dir, rank, world):
    """Each rank extracts a disjoint shard; a file is only ever written by its owner."""
    os.makedirs(feat_dir, exist_ok=True)
    for uid, wav, _ in rows[rank::world]:
        out = os.path.join(feat_dir, uid + ".pt")
        if os.path.exists(out):
            continue
        audio, sr = torchaudio.load(wav)
        fb = torchaudio.compliance.kaldi.fbank(audio * 32768, num_mel_bins=80, sample_frequency=sr)
        torch.save(fb.half(), out + f".tmp{rank}")
        os.replace(out + f".tmp{rank}", out)
    dist.barrier()


class FeatSet(Dataset):
    def __init__(self, rows, feat_dir, sp, train):
        self.rows, self.feat_dir, self.sp = rows, feat_dir, sp
        self.aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(30),
                                 torchaudio.transforms.FrequencyMasking(30),
                                 *[torchaudio.transforms.TimeMasking(40, p=0.05) for _ in range(6)]) if train else None

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        uid, _, text = self.rows[i]
        x = torch.load(os.path.join(self.feat_dir, uid + ".pt")).float()
        x = (x - x.mean(0)) / (x.std(0) + 1e-5)
        if self.aug is not None:
            x = self.aug(x.t()[None])[0].t()
        return x, torch.tensor(self.sp.encode(text)), text


def collate(b):
    x, y, t = zip(*b)
    return (nn.utils.rnn.pad_sequence(x, batch_first=True), torch.tensor([len(i) for i in x]),
            nn.utils.rnn.pad_sequence(y, batch_first=True), torch.tensor([len(i) for i in y]), list(t))


class Model(nn.Module):
    def __init__(self, vocab, d, layers, act_ckpt=False):
        super().__init__()
        self.front = nn.Sequential(nn.Conv2d(1, d // 4, 3, 2), nn.SiLU(), nn.Conv2d(d // 4, d // 4, 3, 2), nn.SiLU())
        self.lin = nn.Linear(d // 4 * 19, d)      # 80 mel bins -> 19 after two stride-2 convs
        enc = torchaudio.models.Conformer(d, 8, 4 * d, layers, 31, dropout=0.1)
        self.layers = enc.conformer_layers
        self.ctc = nn.Linear(d, vocab + 1)
        self.act_ckpt = act_ckpt

    def forward(self, x, lens):
        x = self.front(x[:, None])
        x = self.lin(x.transpose(1, 2).flatten(2))
        lens = (((lens - 1) // 2 - 1) // 2).clamp(min=1, max=x.size(1))
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        h = x.transpose(0, 1)
        for layer in self.layers:
            if self.act_ckpt and self.training:
                h = checkpoint(layer, h, pad, use_reentrant=False)
            else:
                h = layer(h, pad)
        return self.ctc(h.transpose(0, 1)).log_softmax(-1), lens


@torch.no_grad()
def wer(model, loader, sp, blank, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, xl, _, _, texts in loader:
        lp, ol = model(x.to(device), xl.to(device))
        for seq, n, ref in zip(lp.argmax(-1), ol, texts):
            ids = [t for t in torch.unique_consecutive(seq[:n]).tolist() if t != blank]
            s[0] += torchaudio.functional.edit_distance(ref.split(), sp.decode(ids).split())
            s[1] += len(ref.split())
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # feature extraction before the first training step can take a while
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.exp, exist_ok=True)

    train_rows = read_list(os.path.join(args.data, "train.tsv"))
    dev_rows = read_list(os.path.join(args.data, "dev.tsv"))
    sp = ensure_bpe(train_rows, args.exp, args.vocab_size, rank)
    feat_dir = os.path.join(args.data, "fbank80")
    ensure_features(train_rows + dev_rows, feat_dir, rank, world)

    train_set = FeatSet(train_rows, feat_dir, sp, train=True)
    dev_set = FeatSet(dev_rows, feat_dir, sp, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True)
    dev_dl = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), 32, collate_fn=collate,
                        num_workers=4)

    blank = sp.get_piece_size()
    net = Model(sp.get_piece_size(), args.d_model, args.layers, args.act_ckpt).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        # older runs stored the DDP wrapper's state dict
        state = {k.removeprefix("module."): v for k, v in ckpt["model"].items()}
        net.load_state_dict(state)
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(net, device_ids=[local_rank])
    ctc_loss = nn.CTCLoss(blank=blank, zero_infinity=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for it, (x, xl, y, yl, _) in enumerate(train_dl):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, ol = model(x, xl)
            loss = ctc_loss(lp.float().transpose(0, 1), y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.3f}", flush=True)

        dev_wer = wer(model.module, dev_dl, sp, blank, device)
        if rank == 0:
            print(f"epoch {epoch} dev WER {100 * dev_wer:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "wer": dev_wer},
                       os.path.join(args.exp, f"epoch{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

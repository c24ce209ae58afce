"""Character Conformer-CTC (own implementation) on AISHELL-style data.

Train with greedy dev CER for model selection, then decode the test set with
torchaudio's lexicon-free CTC beam search using the best checkpoint.

    torchrun --nproc_per_node=4 20_conformer_char_ctc_beam_test.py --data data/aishell1
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.models.decoder import ctc_decoder


class FeedForward(nn.Module):
    def __init__(self, d, mult=4, p=0.1):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * mult), nn.SiLU(), nn.Dropout(p),
                                 nn.Linear(d * mult, d), nn.Dropout(p))

    def forward(self, x):
        return self.net(x)


class ConvModule(nn.Module):
    def __init__(self, d, k=15, p=0.1):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.norm = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x, pad):
        x = self.ln(x).masked_fill(pad[..., None], 0.0).transpose(1, 2)
        x = F.glu(self.pw1(x), dim=1)
        x = self.pw2(F.silu(self.norm(self.dw(x))))
        return self.drop(x.transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, d, heads, p=0.1):
        super().__init__()
        self.ff1, self.ff2 = FeedForward(d, p=p), FeedForward(d, p=p)
        self.ln_att = nn.LayerNorm(d)
        self.att = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.conv = ConvModule(d, p=p)
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x, pad):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.att(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        x = x + self.conv(x, pad)
        x = x + 0.5 * self.ff2(x)
        return self.ln_out(x)


class ConformerCTC(nn.Module):
    def __init__(self, n_tokens, d=256, heads=4, layers=12, n_mels=80):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2), nn.ReLU())
        self.proj = nn.Linear(d * (((n_mels - 1) // 2 - 1) // 2), d)
        self.pos = nn.Parameter(torch.zeros(1, 2000, d))
        self.blocks = nn.ModuleList([ConformerBlock(d, heads) for _ in range(layers)])
        self.out = nn.Linear(d, n_tokens)

    def forward(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f)) + self.pos[:, :t]
        lens = (((lens - 1) // 2 - 1) // 2).clamp(1, t)
        pad = torch.arange(t, device=x.device)[None] >= lens[:, None]
        for blk in self.blocks:
            x = blk(x, pad)
        return self.out(x).log_softmax(-1), lens


class AishellSet(Dataset):
    def __init__(self, scp, tok2id, train):
        self.items = [l.rstrip("\n").split("\t") for l in open(scp)]
        self.tok2id, self.train = tok2id, train
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(10),
                                     torchaudio.transforms.FrequencyMasking(10),
                                     torchaudio.transforms.TimeMasking(50),
                                     torchaudio.transforms.TimeMasking(50))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav_path, text = self.items[i]
        wav, sr = torchaudio.load(wav_path)
        fb = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=80, sample_frequency=sr,
                                               dither=1.0 if self.train else 0.0)
        fb = fb - fb.mean(0)
        if self.train:
            fb = self.specaug(fb.t()[None])[0].t()
        y = torch.tensor([self.tok2id.get(ch, self.tok2id["<unk>"]) for ch in text.replace(" ", "")])
        return fb, y, text.replace(" ", "")


def collate(batch):
    x, y, t = zip(*batch)
    return (nn.utils.rnn.pad_sequence(x, batch_first=True), torch.tensor([len(a) for a in x]),
            nn.utils.rnn.pad_sequence(y, batch_first=True), torch.tensor([len(a) for a in y]), list(t))


def count_errors(model, loader, id2tok, device, decoder=None):
    errs = torch.zeros(2, device=device, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, xl, _, _, texts in loader:
            lp, ol = model(x.to(device), xl.to(device))
            if decoder is None:
                hyps = []
                for seq, n in zip(lp.argmax(-1), ol):
                    ids = torch.unique_consecutive(seq[:n]).tolist()
                    hyps.append("".join(id2tok[i] for i in ids if i != 0))
            else:
                res = decoder(lp.float().cpu(), ol.cpu().int())
                hyps = ["".join(decoder.idxs_to_tokens(r[0].tokens)).replace("<blank>", "").replace("|", "")
                        for r in res]
            for h, r in zip(hyps, texts):
                errs[0] += torchaudio.functional.edit_distance(list(r), list(h))
                errs[1] += len(r)
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/aishell1")
    ap.add_argument("--exp", default="exp/conformer_char_ctc")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=70)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=25000)
    ap.add_argument("--beam", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokens = [l.split()[0] for l in open(os.path.join(args.data, "tokens.txt"))]   # <blank> <unk> | then chars
    tok2id = {t: i for i, t in enumerate(tokens)}
    id2tok = {i: t for t, i in tok2id.items()}

    train_set = AishellSet(os.path.join(args.data, "train.tsv"), tok2id, train=True)
    dev_set = AishellSet(os.path.join(args.data, "dev.tsv"), tok2id, train=False)
    test_set = AishellSet(os.path.join(args.data, "test.tsv"), tok2id, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True)
    dev_dl = DataLoader(Subset(dev_set, range(rank, len(dev_set), world)), 64, collate_fn=collate, num_workers=4)
    test_dl = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 64, collate_fn=collate,
                         num_workers=4)

    model = DDP(ConformerCTC(len(tokens)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    best_path = os.path.join(args.exp, "best.pt")
    best = float("inf")
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (x, xl, y, yl, _) in enumerate(train_dl):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            lp, ol = model(x, xl)
            loss = ctc(lp.transpose(0, 1), y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.3f}", flush=True)

        cer = count_errors(model.module, dev_dl, id2tok, device)
        if rank == 0:
            print(f"epoch {epoch} dev CER {100 * cer:.2f}", flush=True)
            if cer < best:
                best = cer
                torch.save({"model": model.state_dict(), "epoch": epoch, "cer": cer}, best_path)
        dist.barrier()

    # test: every rank reloads the selected checkpoint and decodes its shard with beam search
    test_model = ConformerCTC(len(tokens)).to(device)
    ckpt = torch.load(best_path, map_location=device)
    test_model.load_state_dict(ckpt["model"])
    decoder = ctc_decoder(lexicon=None, tokens=tokens, beam_size=args.beam, blank_token="<blank>",
                          sil_token="|", unk_word="<unk>")
    test_cer = count_errors(test_model, test_dl, id2tok, device, decoder=decoder)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} dev CER {100 * ckpt['cer']:.2f} test CER (beam {args.beam}) "
              f"{100 * test_cer:.2f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

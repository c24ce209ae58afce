"""
Transformer NMT en->de with joint sentencepiece, beam-search BLEU on dev after every epoch.

torchrun --standalone --nproc_per_node=4 07_nmt_beam_bleu.py --data data/wmt16_en_de --spm data/wmt16_en_de/spm32k.model
"""
import argparse
import math
import os
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, BOS, EOS = 0, 2, 3  # matches spm: --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3


class BitextDataset(Dataset):
    def __init__(self, src_file, tgt_file, sp, max_len=256):
        self.sp = sp
        src = [l.rstrip("\n") for l in open(src_file, encoding="utf-8")]
        tgt = [l.rstrip("\n") for l in open(tgt_file, encoding="utf-8")]
        self.examples = []
        for s, t in zip(src, tgt):
            si, ti = sp.encode(s)[:max_len], sp.encode(t)[:max_len]
            if si and ti:
                self.examples.append((si, ti, t))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


def collate(batch):
    src = [torch.tensor(s + [EOS]) for s, _, _ in batch]
    tgt_in = [torch.tensor([BOS] + t) for _, t, _ in batch]
    tgt_out = [torch.tensor(t + [EOS]) for _, t, _ in batch]
    pad = lambda x: nn.utils.rnn.pad_sequence(x, batch_first=True, padding_value=PAD)
    return pad(src), pad(tgt_in), pad(tgt_out), [r for _, _, r in batch]


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab, d=512, heads=8, enc_layers=6, dec_layers=6, ff=2048, drop=0.1, max_pos=512):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_pos, d)
        self.core = nn.Transformer(d, heads, enc_layers, dec_layers, ff, drop, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def _embed(self, x, offset=0):
        pos = torch.arange(offset, offset + x.size(1), device=x.device)
        return self.emb(x) * math.sqrt(self.d) + self.pos(pos)

    def encode(self, src):
        return self.core.encoder(self._embed(src), src_key_padding_mask=src.eq(PAD)), src.eq(PAD)

    def decode(self, tgt, memory, mem_mask):
        causal = torch.triu(torch.full((tgt.size(1), tgt.size(1)), float("-inf"), device=tgt.device), 1)
        h = self.core.decoder(self._embed(tgt), memory, tgt_mask=causal, tgt_key_padding_mask=tgt.eq(PAD),
                              memory_key_padding_mask=mem_mask)
        return self.out(h)

    def forward(self, src, tgt_in):
        memory, mem_mask = self.encode(src)
        return self.decode(tgt_in, memory, mem_mask)

    @torch.no_grad()
    def generate(self, src, beam=5, max_len_a=1.2, max_len_b=10, lenpen=1.0):
        """simple batched beam search, re-runs the decoder on the full prefix every step"""
        B = src.size(0)
        memory, mem_mask = self.encode(src)
        memory = memory.repeat_interleave(beam, 0)
        mem_mask = mem_mask.repeat_interleave(beam, 0)
        max_len = int(src.ne(PAD).sum(1).max().item() * max_len_a + max_len_b)
        seqs = torch.full((B * beam, 1), BOS, dtype=torch.long, device=src.device)
        scores = torch.zeros(B, beam, device=src.device)
        scores[:, 1:] = -1e9
        finished = [[] for _ in range(B)]
        for t in range(max_len):
            lp = self.decode(seqs, memory, mem_mask)[:, -1].log_softmax(-1)
            V = lp.size(-1)
            cand = (scores.view(-1, 1) + lp).view(B, beam * V)
            top, idx = cand.topk(2 * beam, dim=1)
            beam_idx, tok = idx // V, idx % V
            new_seqs, new_scores = [], torch.full((B, beam), -1e9, device=src.device)
            for b in range(B):
                k = 0
                for s, bi, tk in zip(top[b].tolist(), beam_idx[b].tolist(), tok[b].tolist()):
                    prev = seqs[b * beam + bi]
                    if tk == EOS or t == max_len - 1:
                        if len(finished[b]) < beam:
                            finished[b].append((s / (len(prev) ** lenpen), prev[1:].tolist()))
                        continue
                    if k < beam:
                        new_seqs.append(torch.cat([prev, prev.new_tensor([tk])]))
                        new_scores[b, k] = s
                        k += 1
                while k < beam:
                    new_seqs.append(torch.cat([seqs[b * beam], seqs.new_tensor([PAD])]))
                    k += 1
            seqs = torch.stack(new_seqs)
            scores = new_scores
            if all(len(f) >= beam for f in finished):
                break
        return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


class InverseSqrt:
    def __init__(self, opt, peak, warmup):
        self.opt, self.peak, self.warmup, self.n = opt, peak, warmup, 0

    def step(self):
        self.n += 1
        lr = self.peak * min(self.n / self.warmup, math.sqrt(self.warmup / self.n))
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr


def translate_dev(model, loader, sp, device, beam):
    model.eval()
    hyps, refs = [], []
    for src, _, _, ref in loader:
        out = model.generate(src.to(device), beam=beam)
        hyps += [sp.decode(h) for h in out]
        refs += ref
    model.train()
    return hyps, refs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--spm", required=True)
    parser.add_argument("--out", default="checkpoints/nmt_en_de")
    parser.add_argument("--bsz", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--beam", type=int, default=4)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    train = BitextDataset(os.path.join(args.data, "train.en"), os.path.join(args.data, "train.de"), sp)
    dev = BitextDataset(os.path.join(args.data, "newstest2013.en"), os.path.join(args.data, "newstest2013.de"), sp)
    train_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bsz, sampler=train_sampler, collate_fn=collate, num_workers=4,
                          drop_last=True, pin_memory=True)
    dev_shard = torch.utils.data.Subset(dev, range(rank, len(dev), world))
    dev_dl = DataLoader(dev_shard, batch_size=32, collate_fn=collate)

    torch.manual_seed(1)
    model = DDP(Seq2SeqTransformer(sp.get_piece_size()).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = InverseSqrt(opt, args.lr, args.warmup)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_bleu = -1.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (src, tin, tout, _) in enumerate(train_dl):
            src, tin, tout = src.to(device), tin.to(device), tout.to(device)
            logits = model(src, tin)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), tout.view(-1), ignore_index=PAD,
                                   label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            lr = sched.step()
            opt.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_dl)} loss {loss.item():.3f} lr {lr:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        hyps, refs = translate_dev(model, dev_dl, sp, device, args.beam)
        gathered = [None] * world
        dist.all_gather_object(gathered, (hyps, refs))
        if rank == 0:
            all_h = [h for g in gathered for h in g[0]]
            all_r = [r for g in gathered for r in g[1]]
            bleu = sacrebleu.corpus_bleu(all_h, [all_r]).score
            print(f"epoch {epoch} | dev BLEU {bleu:.2f} | {len(all_h)} sents", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "checkpoint_last.pt"))
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(model.module.state_dict(), os.path.join(args.out, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

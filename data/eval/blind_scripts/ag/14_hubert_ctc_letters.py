"""Fine-tune HuBERT-Base (torchaudio) with a letter CTC head on LibriLight-10h.

torchrun --nproc_per_node=4 14_hubert_ctc_letters.py --data /data/librilight_10h --exp exp/hubert_ft10h
"""
import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import editdistance

LETTERS = ["-", "|"] + list("ETAONIHSRDLUMWCFGYPBVK'XJQZ")  # "-" = blank, "|" = word boundary
STOI = {c: i for i, c in enumerate(LETTERS)}


class LibriLightSubset(Dataset):
    """Reads the flac/trans.txt layout of LibriLight limited-resource splits."""

    def __init__(self, root):
        self.items = []
        for trans in sorted(Path(root).rglob("*.trans.txt")):
            for line in trans.read_text().splitlines():
                uid, text = line.split(" ", 1)
                self.items.append((trans.parent / f"{uid}.flac", text))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        wav, sr = torchaudio.load(str(path))
        wav = wav[0]
        labels = torch.tensor([STOI[c] for c in text.replace(" ", "|") if c in STOI])
        return wav, labels, text


def collate(batch):
    wavs, labels, texts = zip(*batch)
    return (torch.nn.utils.rnn.pad_sequence(wavs, batch_first=True), torch.tensor([w.numel() for w in wavs]),
            torch.cat(labels), torch.tensor([l.numel() for l in labels]), list(texts))


def tri_stage(step, total, warmup=0.1, hold=0.4):
    w, h = int(total * warmup), int(total * hold)
    if step < w:
        return 0.01 + 0.99 * step / w
    if step < w + h:
        return 1.0
    return math.exp(math.log(0.05) * (step - w - h) / max(1, total - w - h))


def build_model(vocab_size):
    bundle = torchaudio.pipelines.HUBERT_BASE
    model = torchaudio.models.hubert_base(aux_num_out=vocab_size, encoder_layer_drop=0.0)
    missing, unexpected = model.load_state_dict(bundle.get_model().state_dict(), strict=False)
    assert all(k.startswith("aux") for k in missing), missing
    return model


def greedy(emissions, lengths):
    out = []
    for e, n in zip(emissions.argmax(-1).cpu(), lengths.cpu()):
        toks = torch.unique_consecutive(e[:n]).tolist()
        s = "".join(LETTERS[t] for t in toks if t != 0)
        out.append(" ".join(s.replace("|", " ").split()))
    return out


def evaluate(model, loader, device):
    model.eval()
    n_err, n_words = 0, 0
    with torch.no_grad():
        for wav, wav_len, _, _, texts in loader:
            emissions, out_len = model.module(wav.to(device), wav_len.to(device))
            for hyp, ref in zip(greedy(emissions, out_len), texts):
                n_err += editdistance.eval(hyp.split(), ref.split())
                n_words += len(ref.split())
    stats = torch.tensor([n_err, n_words], dtype=torch.long)
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / max(stats[1].item(), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--dev", default="/data/LibriSpeech/dev-other")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--max-updates", type=int, default=20000)
    ap.add_argument("--freeze-updates", type=int, default=10000)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=1000)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_set = LibriLightSubset(args.data)
    dev_set = LibriLightSubset(args.dev)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)),
                            batch_size=8, collate_fn=collate, num_workers=2)

    model = build_model(len(LETTERS)).to(device)
    for p in model.feature_extractor.parameters():
        p.requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: tri_stage(s, args.max_updates))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        Path(args.exp).mkdir(parents=True, exist_ok=True)

    update, epoch, best = 0, 0, float("inf")
    t0 = time.time()
    model.train()
    while update < args.max_updates:
        sampler.set_epoch(epoch)
        for wav, wav_len, labels, label_len, _ in train_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                emissions, out_len = model(wav.to(device), wav_len.to(device))
            log_probs = emissions.float().log_softmax(-1).transpose(0, 1)
            loss = F.ctc_loss(log_probs, labels.to(device), out_len, label_len.to(device),
                              blank=0, reduction="sum", zero_infinity=True)
            loss = loss / label_len.sum().to(device)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if update < args.freeze_updates:
                # only the CTC head is trained at first (fairseq freeze_finetune_updates)
                for n, p in model.module.named_parameters():
                    if p.grad is not None and not n.startswith("aux"):
                        p.grad.zero_()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            update += 1

            if rank == 0 and update % 100 == 0:
                print(f"upd {update} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / update:.2f}s/upd", flush=True)
            if update % args.eval_every == 0:
                wer = evaluate(model, dev_loader, device)
                if rank == 0:
                    print(f"upd {update} dev-other WER {wer * 100:.2f}", flush=True)
                    if wer < best:
                        best = wer
                        torch.save(model.module.state_dict(), Path(args.exp) / "best.pt")
                dist.barrier()
            if update >= args.max_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

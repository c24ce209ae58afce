"""wav2vec2-large CTC fine-tuning on the call-centre transcripts.

Runs as a 3-replica StatefulSet "asr" behind the headless Service "asr", 8 GPUs
per pod, so the pods are asr-0.asr, asr-1.asr, asr-2.asr. Node rank comes from
the pod ordinal, rendezvous is plain tcp:// on pod 0. Pod spec:

    env:
      - {name: NUM_NODES, value: "3"}
    command: ["python", "/app/finetune_ctc.py", "--manifest-dir", "/data/cc-asr",
              "--out", "/ckpt/w2v2-cc", "--resume", "/ckpt/w2v2-cc/last.pt"]
"""
import argparse
import json
import os
import socket
import time

import jiwer
import soundfile as sf
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor, get_linear_schedule_with_warmup


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--base", default="facebook/wav2vec2-large-lv60")
    p.add_argument("--processor", default="/data/cc-asr/processor")
    p.add_argument("--port", type=int, default=23456)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--bs", type=int, default=8, help="per GPU; --lr was tuned for 3 pods x 8 GPUs x 8")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-sec", type=float, default=16.0)
    return p.parse_args()


class Manifest(Dataset):
    def __init__(self, path, processor, max_sec):
        with open(path) as fh:
            rows = [json.loads(l) for l in fh]
        self.rows = [r for r in rows if r["duration"] <= max_sec]
        self.proc = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio"], dtype="float32")
        assert sr == 16000, r["audio"]
        x = self.proc.feature_extractor(wav, sampling_rate=16000).input_values[0]
        y = self.proc.tokenizer(r["text"].lower()).input_ids
        return torch.tensor(x), torch.tensor(y), r["text"].lower()


def make_collate(proc):
    def collate(batch):
        xs, ys, texts = zip(*batch)
        feats = proc.feature_extractor.pad({"input_values": [x.numpy() for x in xs]}, return_tensors="pt",
                                           return_attention_mask=True)
        labels = proc.tokenizer.pad({"input_ids": [y.tolist() for y in ys]}, return_tensors="pt")
        lab = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
        return feats["input_values"], feats["attention_mask"], lab, list(texts)
    return collate


@torch.no_grad()
def word_error_rate(model, loader, proc, device, world):
    model.eval()
    hyps, refs = [], []
    for x, mask, _, texts in loader:
        logits = model(x.to(device), attention_mask=mask.to(device)).logits
        hyps += proc.batch_decode(logits.argmax(-1))
        refs += texts
    out = [None] * world
    dist.all_gather_object(out, (hyps, refs))
    model.train()
    H = [h for o in out for h in o[0]]
    R = [r for o in out for r in o[1]]
    return jiwer.wer(R, H)


def worker(local_rank, node_rank, nnodes, args):
    ngpus = torch.cuda.device_count()
    rank = node_rank * ngpus + local_rank
    world = nnodes * ngpus
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://asr-0.asr:{args.port}", rank=rank, world_size=world)

    proc = Wav2Vec2Processor.from_pretrained(args.processor)
    train_ds = Manifest(os.path.join(args.manifest_dir, "train.jsonl"), proc, args.max_sec)
    dev_ds = Manifest(os.path.join(args.manifest_dir, "dev.jsonl"), proc, 60.0)
    collate = make_collate(proc)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=6,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=8, collate_fn=collate,
                        num_workers=4)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.base, vocab_size=len(proc.tokenizer), pad_token_id=proc.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", layerdrop=0.0, mask_time_prob=0.05, ctc_zero_infinity=True,
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_wer = 0, 1.0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_wer = ckpt["epoch"] + 1, ckpt["best_wer"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for step, (x, mask, labels, _) in enumerate(train_dl):
            x, mask, labels = x.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            agg += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.3f}", flush=True)
        dist.all_reduce(agg)

        wer = word_error_rate(model.module, dev_dl, proc, device, world)
        if rank == 0:
            print(f"epoch {epoch} train_loss {(agg[0] / agg[1]).item():.4f} dev_wer {wer:.4f} "
                  f"({(time.time() - t0) / 60:.1f} min)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best_wer": min(wer, best_wer)}
            torch.save(state, os.path.join(args.out, "last.pt.tmp"))
            os.replace(os.path.join(args.out, "last.pt.tmp"), os.path.join(args.out, "last.pt"))
            if wer < best_wer:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                proc.save_pretrained(os.path.join(args.out, "best"))
        best_wer = min(wer, best_wer)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = cli()
    host = socket.gethostname()             # asr-<ordinal>
    node_rank = int(host.rsplit("-", 1)[1])
    nnodes = int(os.environ["NUM_NODES"])
    mp.spawn(worker, args=(node_rank, nnodes, args), nprocs=torch.cuda.device_count())


if __name__ == "__main__":
    main()

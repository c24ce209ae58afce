"""data2vec-audio CTC fine-tuning with automatic resume (for preemptible cluster slots).

If <exp>/latest.pt exists the run continues from it, otherwise it starts from
the pretrained checkpoint.

    torchrun --nproc_per_node=4 18_data2vec_ctc_autoresume.py --exp exp/d2v_base_ls100
"""
import argparse
import json
import logging
import os
import signal
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.functional import edit_distance
from transformers import Data2VecAudioForCTC, Wav2Vec2Processor

logger = logging.getLogger("d2v")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", default="facebook/data2vec-audio-base")
    ap.add_argument("--processor", default="facebook/data2vec-audio-base-960h")
    ap.add_argument("--train_json", default="data/ls100/train.jsonl")
    ap.add_argument("--dev_json", default="data/ls100/dev_clean.jsonl")
    ap.add_argument("--exp", default="exp/d2v_base_ls100")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--max_sec", type=float, default=18.0)
    return ap.parse_args()


class JsonlAudio(Dataset):
    def __init__(self, path, processor, max_sec=None):
        rows = [json.loads(l) for l in open(path)]
        if max_sec is not None:
            rows = [r for r in rows if r["duration"] <= max_sec]
        self.rows = rows
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["path"], dtype="float32")
        assert sr == 16000, r["path"]
        values = self.processor.feature_extractor(wav, sampling_rate=16000).input_values[0]
        labels = self.processor.tokenizer(r["text"].upper()).input_ids
        return np.asarray(values, dtype=np.float32), labels, r["text"].upper()


class Collator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        vals, labels, texts = zip(*batch)
        inp = self.processor.feature_extractor.pad({"input_values": list(vals)}, padding=True,
                                                   return_attention_mask=True, return_tensors="pt")
        lab = self.processor.tokenizer.pad({"input_ids": list(labels)}, padding=True, return_tensors="pt")
        y = lab["input_ids"].masked_fill(lab["attention_mask"].ne(1), -100)
        return inp["input_values"], inp["attention_mask"], y, list(texts)


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x, att, _, texts in loader:
        logits = model(x.to(device), attention_mask=att.to(device)).logits
        hyps = processor.batch_decode(logits.argmax(-1))
        for h, r in zip(hyps, texts):
            tot[0] += edit_distance(r.split(), h.split())
            tot[1] += len(r.split())
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"%(asctime)s [{rank}] %(message)s")

    stop = {"flag": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(flag=True))

    processor = Wav2Vec2Processor.from_pretrained(args.processor)
    train_ds = JsonlAudio(args.train_json, processor, args.max_sec)
    dev_ds = JsonlAudio(args.dev_json, processor)
    collator = Collator(processor)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=11)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                          num_workers=6, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=8,
                        collate_fn=collator, num_workers=2)

    model = Data2VecAudioForCTC.from_pretrained(
        args.pretrained, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, layerdrop=0.0,
        mask_time_prob=0.05, mask_feature_prob=0.0016, mask_feature_length=64,
    )
    model.freeze_feature_encoder()
    model.to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    total = args.epochs * len(train_dl)
    warm = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else max(0.0, (total - s) / max(1, total - warm)))

    latest = os.path.join(args.exp, "latest.pt")
    start_epoch, best = 0, float("inf")
    if os.path.exists(latest):
        ckpt = torch.load(latest)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        logger.info("resumed from %s (epoch %d)", latest, ckpt["epoch"])
        del ckpt

    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    os.makedirs(args.exp, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (x, att, y, _) in enumerate(train_dl):
            x, att, y = x.to(device, non_blocking=True), att.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp(x, attention_mask=att, labels=y).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if it % 100 == 0:
                logger.info("epoch %d it %d/%d loss %.4f lr %.2e (%.0fs)", epoch, it, len(train_dl),
                            loss.item(), sched.get_last_lr()[0], time.time() - t0)

        wer = evaluate(model, dev_dl, processor, device)
        best = min(best, wer)
        logger.info("epoch %d dev-clean WER %.2f (best %.2f)", epoch, 100 * wer, 100 * best)
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, latest + ".tmp")
            os.replace(latest + ".tmp", latest)
            if wer == best:
                model.save_pretrained(os.path.join(args.exp, "best"))
                processor.save_pretrained(os.path.join(args.exp, "best"))
        dist.barrier()

        flag = torch.tensor([int(stop["flag"])], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            logger.info("preemption signal received, exiting after epoch %d", epoch)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

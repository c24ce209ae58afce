"""M2M-100 (418M) fine-tuning for English -> {Kazakh, Kyrgyz, Uzbek}.

Dev hypotheses are gathered as token ids (cheaper than pickling strings) and detokenized
on rank 0, which also writes them to disk for later analysis.

torchrun --nproc_per_node=8 14_m2m100_gather_hyps.py --data data/central_asia --out exp/m2m_ca
"""
import argparse
import json
import os
import time

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer, get_cosine_schedule_with_warmup

TGT_LANGS = ("kk", "ky", "uz")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="facebook/m2m100_418M")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bsz", type=int, default=24)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--beams", type=int, default=5)
    return p.parse_args()


class PairFile(Dataset):
    def __init__(self, path, tgt_lang):
        with open(path, encoding="utf-8") as f:
            self.rows = [json.loads(l) for l in f]
        self.tgt_lang = tgt_lang

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"src": r["en"], "tgt": r[self.tgt_lang], "tgt_lang": self.tgt_lang}


class Collate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        self.tok.src_lang = "en"
        feats = []
        for ex in batch:
            self.tok.tgt_lang = ex["tgt_lang"]
            feats.append(self.tok(ex["src"], text_target=ex["tgt"], truncation=True, max_length=self.max_len))
        ids = pad_sequence([torch.tensor(f["input_ids"]) for f in feats], batch_first=True,
                           padding_value=self.tok.pad_token_id)
        labels = pad_sequence([torch.tensor(f["labels"]) for f in feats], batch_first=True, padding_value=-100)
        return {"input_ids": ids, "attention_mask": ids.ne(self.tok.pad_token_id).long(), "labels": labels}


@torch.no_grad()
def evaluate_lang(model, tok, dev, lang, args, device, rank, world):
    model.eval()
    tok.src_lang = "en"
    sampler = DistributedSampler(range(len(dev)), shuffle=False)
    order = list(sampler)
    gen_ids, idx = [], []
    for b in range(0, len(order), 32):
        chunk = order[b : b + 32]
        enc = tok([dev.rows[i]["en"] for i in chunk], return_tensors="pt", padding=True, truncation=True,
                  max_length=args.max_len).to(device)
        out = model.generate(**enc, forced_bos_token_id=tok.get_lang_id(lang), num_beams=args.beams,
                             max_new_tokens=args.max_len)
        gen_ids.extend(out.unbind(0))
        idx.extend(chunk)
    model.train()

    local = pad_sequence(gen_ids, batch_first=True, padding_value=tok.pad_token_id)
    local_idx = torch.tensor(idx, device=device)
    all_ids = [torch.empty_like(local) for _ in range(world)]
    all_idx = [torch.empty_like(local_idx) for _ in range(world)]
    dist.all_gather(all_ids, local)
    dist.all_gather(all_idx, local_idx)
    if rank != 0:
        return None

    hyps = {}
    for ids, ix in zip(all_ids, all_idx):
        for row, i in zip(tok.batch_decode(ids, skip_special_tokens=True), ix.tolist()):
            hyps[i] = row  # DistributedSampler padding repeats a few indices
    hyp_list = [hyps[i] for i in range(len(dev))]
    refs = [r[lang] for r in dev.rows]
    with open(os.path.join(args.out, f"dev.en-{lang}.hyp"), "w", encoding="utf-8") as f:
        f.write("\n".join(hyp_list) + "\n")
    return {"bleu": sacrebleu.corpus_bleu(hyp_list, [refs]).score,
            "chrf": sacrebleu.corpus_chrf(hyp_list, [refs], word_order=2).score}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    tok = M2M100Tokenizer.from_pretrained(args.model)
    model = M2M100ForConditionalGeneration.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    train = ConcatDataset([PairFile(os.path.join(args.data, f"train.en-{l}.jsonl"), l) for l in TGT_LANGS])
    dev = {l: PairFile(os.path.join(args.data, f"dev.en-{l}.jsonl"), l) for l in TGT_LANGS}
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=Collate(tok, args.max_len),
                        num_workers=4, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, len(loader) * args.epochs)
    scaler = torch.cuda.amp.GradScaler()

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0, run = time.time(), torch.zeros(2, device=device)
        for step, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ddp(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (step + 1) % 100 == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"ep {epoch} step {step + 1}/{len(loader)} loss {(run[0] / run[1]).item():.4f} "
                          f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)
                run.zero_()

        results = {l: evaluate_lang(model, tok, dev[l], l, args, device, rank, world) for l in TGT_LANGS}
        if rank == 0:
            avg = sum(r["chrf"] for r in results.values()) / len(results)
            print(f"epoch {epoch}: " + "  ".join(f"en-{l} BLEU {r['bleu']:.2f} chrF++ {r['chrf']:.2f}"
                                               for l, r in results.items()) + f"  avg chrF++ {avg:.2f}", flush=True)
            if avg > best:
                best = avg
                model.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

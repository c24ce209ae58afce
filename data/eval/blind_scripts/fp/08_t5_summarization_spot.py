"""T5-base fine-tuning for abstractive summarization on spot GPUs.

The dataset is tokenized ahead of time (scripts/tokenize_cnndm.py) and stored with
`save_to_disk`. Training is launched with torchrun --max-restarts so that a
preempted node is replaced and the run continues from <output>/state.pt.
"""
import argparse
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, T5ForConditionalGeneration
from transformers.optimization import Adafactor, get_inverse_sqrt_schedule

log = logging.getLogger(__name__)


class Preemption:
    """Remembers that the cloud provider asked us to shut down."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        log.warning("received signal %d, will checkpoint and exit", signum)
        self.requested = True


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--model", default="t5-base")
    p.add_argument("--output", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="Adafactor, global batch 8 x 16 = 128")
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def save_state(path, model, optimizer, scheduler, epoch, batch_idx, step):
    tmp = path + ".tmp"
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "batch_idx": batch_idx,
        "step": step,
    }, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        ntok = (batch["labels"] != -100).sum()
        s[0] += out.loss.float() * ntok
        s[1] += ntok
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    preemption = Preemption()
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_from_disk(args.data_dir)
    model = T5ForConditionalGeneration.from_pretrained(args.model).to(device)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(data["validation"], batch_size=args.batch_size, collate_fn=collator,
                            sampler=DistributedSampler(data["validation"], shuffle=False), num_workers=2)

    optimizer = Adafactor(model.parameters(), lr=args.lr, relative_step=False, scale_parameter=False,
                          warmup_init=False)
    scheduler = get_inverse_sqrt_schedule(optimizer, num_warmup_steps=args.warmup)

    state_path = os.path.join(args.output, "state.pt")
    start_epoch, start_batch, step = 0, 0, 0
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location="cpu")
        model.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        start_epoch, start_batch, step = st["epoch"], st["batch_idx"], st["step"]
        log.info("resuming from epoch %d batch %d (step %d)", start_epoch, start_batch, step)

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        batch_idx = 0
        for batch_idx, batch in enumerate(train_loader):
            if epoch == start_epoch and batch_idx < start_batch:
                continue
            if preemption.requested:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                log.info("epoch %d batch %d step %d loss %.4f %.2f it/s", epoch, batch_idx, step,
                         loss.item(), 100 / (time.time() - t0))
                t0 = time.time()
            if step % args.save_every == 0:
                if rank == 0:
                    save_state(state_path, model, optimizer, scheduler, epoch, batch_idx + 1, step)
                dist.barrier()

        if preemption.requested:
            if rank == 0:
                save_state(state_path, model, optimizer, scheduler, epoch, batch_idx, step)
                log.info("checkpoint written at step %d, exiting for restart", step)
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)

        val = eval_loss(model, val_loader, device)
        log.info("epoch %d done, val loss %.4f", epoch, val)
        if rank == 0:
            save_state(state_path, model, optimizer, scheduler, epoch + 1, 0, step)
            model.module.save_pretrained(os.path.join(args.output, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

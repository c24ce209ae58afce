# Reduced from EleutherAI/sparsify (sae/trainer.py save(), fixed in PR #5): the other
# ranks leave the function early, so only rank 0 reaches the barrier.
import torch
import torch.distributed as dist


def save(state: dict, path: str) -> None:
    if dist.get_rank() != 0:
        return
    torch.save(state, path)
    dist.barrier()  # expect: collective-mismatch


def main() -> None:
    dist.init_process_group("gloo")
    for step in range(3):
        if step % 2:
            continue
        save({"step": step}, f"step{step}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

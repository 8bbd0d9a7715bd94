"""What runs on the batch host around the ranks (the batch script calls each as `python -m`): the health gate's
verdict, each start and end of the allocation, how the ranks ended, and the one requeue decision with the
nodes a requeue leaves out. Torch-free, stdlib only."""

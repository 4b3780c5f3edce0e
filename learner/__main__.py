"""python -m learner --config RUN_DIR/config/run.yaml: one learner rank."""

from learner.run import main

if __name__ == "__main__":
    main()

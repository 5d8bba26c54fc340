from benches.script_study.study import main

main()
